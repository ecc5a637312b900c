"""The picker's admin API (``proto/fairway/v1/admin.proto``): live tenants and endpoints."""
