"""tpuserve.cli: the `tpuserve` command line, above every layer.

  main.py      main(argv): `tpuserve serve|gateway|grpc|generate|convert` -> the command's own main(argv)
  settings.py  the one reader of the YAML settings files (`engine:`/`server:`/`gateway:` sections or a flat
               file) and the rule defaults -> file section -> flags that builds a layer's frozen settings
  jsonlog.py   structured logs: one JSON object per line, set up before a process runs
  gateway.py   `tpuserve gateway`: the gateway's settings (GatewaySettings), JSON logs, its main
  backend.py   `tpuserve grpc`: the backend's settings (ServerSettings, EngineConfig), JSON logs, its main
  serve.py     `tpuserve serve`: the backend as a child process (`tpuserve grpc`), the gateway in this one

The one place that knows every layer: each layer keeps its own frozen settings, its flags and its own
`main(argv, settings=None)` (http_gateway/serve.py, grpc_service/server.py), which the command line calls with
the finished settings; run on its own, a layer's main takes its flags only and logs plain text.
sampler/generate_cli.py and model/convert_cli.py take flags only. No layer imports this package.
"""
