"""A discrete-event simulator of a continuous-batching engine, driving the real scheduling core."""
