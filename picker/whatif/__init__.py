"""What if: a metering log replayed under a proposed config before it is applied.

``python -m picker.whatif LOG --baseline current.yaml --candidate proposed.yaml``. The log is read
as arrivals (``log``), replayed through the pool simulator running the picker's own gate
(``replay``), and the configs compared per tenant and lane (``report``). ``--fast``
(``fast``) replays event by event, a few operations a request, for days of traffic;
``--coarse K`` (``coarse``) steps the engines K tokens at a time. The package stands
beside the simulator: it may use the core, the config and ``picker.sim``, nothing of the server
(an import-linter contract in ``pyproject.toml``).
"""
