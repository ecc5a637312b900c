"""fairway: a tenant-fair Endpoint Picker for the Gateway API Inference Extension."""
