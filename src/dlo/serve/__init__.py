"""dlo's HTTP server: an OpenAI-style image or video API whose replica processes each stream one
pipeline with dlo (`dlo serve` is its command line, in dlo.cli.serve).

Needs the `[serve]` extra (fastapi, uvicorn, prometheus_client): `pip install 'dlo[serve]'`.
server.py binds and serves; app.py is the FastAPI app; pool.py the replica pool and its
metrics; replica.py one replica process; requests.py the request bodies and their checks;
videos.py the video jobs; drain.py the SIGTERM drain; devices.py the replicas' devices.
"""
