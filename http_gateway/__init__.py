"""tpuserve.http_gateway: the OpenAI-compatible HTTP front end. It talks to backends only over gRPC (the proto
stubs) and never imports JAX or the backend's packages, so it runs as a small separate process in front of one
or more backends.

  serve.py            main(argv): the gateway process (`tpuserve gateway`), uvicorn; its threads
  settings.py         GatewaySettings (flags, the YAML `gateway:` section) and parse_args
  app.py              create_app(): routes, lifespan of the backend pool, disconnect -> cancel
  auth.py             bearer-token check for /v1/* (constant time)
  observability.py    limits (body size, concurrency, n), Prometheus /metrics, per-request JSON log lines
  backends.py         grpc.aio channels, model discovery, health, round-robin + failover on UNAVAILABLE
  request_models.py   request bodies with the spec's bounds (extra fields forbidden)
  request_parsing.py  body bytes -> model, or a 400 naming the offending field
  proto_mapping.py    shared request fields -> SamplingParams / StoppingCriteria
  chat.py             /v1/chat/completions (JSON and SSE)
  completions.py      /v1/completions (JSON and SSE; batched/token-id prompts, echo, best_of)
  samples.py          backend messages -> per-sample results, finish reasons
  logprobs.py         raw token bytes -> chat and legacy logprob JSON (docs/http-api.md, "Logprob rules")
  response_models.py  response bodies
  openapi.py          the /openapi.json document
  errors.py           the OpenAI error shape and the gRPC status -> HTTP mapping
  sse.py              SSE framing
"""
