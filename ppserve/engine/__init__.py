"""The engine: the step loop, the executors that build the pipeline, and the offline API."""
