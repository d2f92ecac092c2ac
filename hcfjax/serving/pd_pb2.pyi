from hcfjax.serving import hcfjax_pb2 as _hcfjax_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("key", "tokens", "sampling", "seed", "count", "dest")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DEST_FIELD_NUMBER: _ClassVar[int]
    key: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: _hcfjax_pb2.SamplingParams
    seed: int
    count: int
    dest: str
    def __init__(self, key: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_hcfjax_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., count: _Optional[int] = ..., dest: _Optional[str] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first_token", "drafts")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    drafts: bytes
    def __init__(self, first_token: _Optional[int] = ..., drafts: _Optional[bytes] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("role", "page_size", "cache_dtype", "layers", "transport", "dp", "max_slots", "total_pages", "free_pages", "running", "queued", "pages_held")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    MAX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PAGES_HELD_FIELD_NUMBER: _ClassVar[int]
    role: str
    page_size: int
    cache_dtype: str
    layers: int
    transport: str
    dp: int
    max_slots: int
    total_pages: int
    free_pages: int
    running: int
    queued: int
    pages_held: int
    def __init__(self, role: _Optional[str] = ..., page_size: _Optional[int] = ..., cache_dtype: _Optional[str] = ..., layers: _Optional[int] = ..., transport: _Optional[str] = ..., dp: _Optional[int] = ..., max_slots: _Optional[int] = ..., total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., pages_held: _Optional[int] = ...) -> None: ...
