"""Deployment files of vllm-infinitehip (Ray cluster launcher, Ray Serve LLM, KubeRay).

A package only so that ``deploy.serve.app:build_app`` is an import path for ``serve run`` /
``serve deploy`` / RayService; see deploy/README.md.
"""
