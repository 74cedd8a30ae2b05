"""The app state without Qt: open model, project, engine, telemetry; emits events (psygnal)."""
