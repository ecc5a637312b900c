"""Reading model servers' ``/metrics``: load and capacity of each endpoint."""

from picker.scrape.scraper import EndpointFigures, Scraper, parse_vllm_metrics

__all__ = ["EndpointFigures", "Scraper", "parse_vllm_metrics"]
