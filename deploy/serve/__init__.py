"""The Ray Serve LLM app: :func:`deploy.serve.app.build_app`."""
