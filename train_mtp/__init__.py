"""Corpus and tokenizer, base pretraining of the embedded model, MTP-head training and evaluation."""
