from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListTenantsRequest(_message.Message):
    __slots__ = ("tenants", "limit", "page_token")
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedScalarFieldContainer[str]
    limit: int
    page_token: str
    def __init__(self, tenants: _Optional[_Iterable[str]] = ..., limit: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class BudgetWindow(_message.Message):
    __slots__ = ("window", "remaining_tokens", "capacity_tokens")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    REMAINING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    window: str
    remaining_tokens: float
    capacity_tokens: int
    def __init__(self, window: _Optional[str] = ..., remaining_tokens: _Optional[float] = ..., capacity_tokens: _Optional[int] = ...) -> None: ...

class TenantState(_message.Message):
    __slots__ = ("tenant", "lane", "weight", "configured", "virtual_counter", "fairness_debt", "service_share", "window_service", "total_service", "queued_requests", "queued_tokens", "running_requests", "running_tokens", "budgets")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_COUNTER_FIELD_NUMBER: _ClassVar[int]
    FAIRNESS_DEBT_FIELD_NUMBER: _ClassVar[int]
    SERVICE_SHARE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SERVICE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SERVICE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    lane: str
    weight: float
    configured: bool
    virtual_counter: float
    fairness_debt: float
    service_share: float
    window_service: float
    total_service: float
    queued_requests: int
    queued_tokens: int
    running_requests: int
    running_tokens: int
    budgets: _containers.RepeatedCompositeFieldContainer[BudgetWindow]
    def __init__(self, tenant: _Optional[str] = ..., lane: _Optional[str] = ..., weight: _Optional[float] = ..., configured: _Optional[bool] = ..., virtual_counter: _Optional[float] = ..., fairness_debt: _Optional[float] = ..., service_share: _Optional[float] = ..., window_service: _Optional[float] = ..., total_service: _Optional[float] = ..., queued_requests: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., running_requests: _Optional[int] = ..., running_tokens: _Optional[int] = ..., budgets: _Optional[_Iterable[_Union[BudgetWindow, _Mapping]]] = ...) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants", "window_seconds", "taken_at_unix", "next_page_token", "total_tenants")
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TAKEN_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantState]
    window_seconds: float
    taken_at_unix: float
    next_page_token: str
    total_tenants: int
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantState, _Mapping]]] = ..., window_seconds: _Optional[float] = ..., taken_at_unix: _Optional[float] = ..., next_page_token: _Optional[str] = ..., total_tenants: _Optional[int] = ...) -> None: ...

class ListEndpointsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EndpointState(_message.Message):
    __slots__ = ("address", "budget_tokens", "inflight_tokens", "inflight_requests", "waiting", "kv_usage", "draining")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    address: str
    budget_tokens: int
    inflight_tokens: int
    inflight_requests: int
    waiting: float
    kv_usage: float
    draining: bool
    def __init__(self, address: _Optional[str] = ..., budget_tokens: _Optional[int] = ..., inflight_tokens: _Optional[int] = ..., inflight_requests: _Optional[int] = ..., waiting: _Optional[float] = ..., kv_usage: _Optional[float] = ..., draining: _Optional[bool] = ...) -> None: ...

class ListEndpointsResponse(_message.Message):
    __slots__ = ("endpoints",)
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedCompositeFieldContainer[EndpointState]
    def __init__(self, endpoints: _Optional[_Iterable[_Union[EndpointState, _Mapping]]] = ...) -> None: ...

class RecentRequestsRequest(_message.Message):
    __slots__ = ("since_seconds", "limit")
    SINCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    since_seconds: float
    limit: int
    def __init__(self, since_seconds: _Optional[float] = ..., limit: _Optional[int] = ...) -> None: ...

class RequestRecord(_message.Message):
    __slots__ = ("tenant_id", "model", "priority_lane", "lane_asked", "arrived_at", "timestamp", "prompt_tokens", "completion_tokens", "cached_prompt_tokens", "max_tokens", "stream", "outcome", "endpoint", "queue_ms", "ttft_ms", "e2e_ms", "demoted")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_LANE_FIELD_NUMBER: _ClassVar[int]
    LANE_ASKED_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_AT_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    model: str
    priority_lane: str
    lane_asked: str
    arrived_at: float
    timestamp: float
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    max_tokens: int
    stream: bool
    outcome: str
    endpoint: str
    queue_ms: float
    ttft_ms: float
    e2e_ms: float
    demoted: bool
    def __init__(self, tenant_id: _Optional[str] = ..., model: _Optional[str] = ..., priority_lane: _Optional[str] = ..., lane_asked: _Optional[str] = ..., arrived_at: _Optional[float] = ..., timestamp: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stream: _Optional[bool] = ..., outcome: _Optional[str] = ..., endpoint: _Optional[str] = ..., queue_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., e2e_ms: _Optional[float] = ..., demoted: _Optional[bool] = ...) -> None: ...

class RecentRequestsResponse(_message.Message):
    __slots__ = ("records", "taken_at_unix", "held", "capacity", "oldest_arrived_at", "truncated")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    TAKEN_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    OLDEST_ARRIVED_AT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[RequestRecord]
    taken_at_unix: float
    held: int
    capacity: int
    oldest_arrived_at: float
    truncated: bool
    def __init__(self, records: _Optional[_Iterable[_Union[RequestRecord, _Mapping]]] = ..., taken_at_unix: _Optional[float] = ..., held: _Optional[int] = ..., capacity: _Optional[int] = ..., oldest_arrived_at: _Optional[float] = ..., truncated: _Optional[bool] = ...) -> None: ...
