"""fairway's Kubernetes operator: TenantPolicy resources into the picker's config."""
