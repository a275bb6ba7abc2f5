"""Serving tokenmill behind other systems: `ray_app` runs the OpenAI server as a Ray Serve application.

Only the `ray_app` and `prefix_router` modules import Ray (the optional `ray` extra); nothing in the
rest of tokenmill imports this package.
"""
