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
