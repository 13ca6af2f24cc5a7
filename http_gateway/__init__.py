"""tpuserve.http_gateway: the OpenAI-compatible HTTP front end. It talks to backends only over gRPC (the proto
stubs) and never imports JAX or the backend's packages, so it runs as a small separate process in front of one
or more backends.

  serve.py              main(argv): the gateway process (`tpuserve gateway`), uvicorn; its threads
  settings.py           GatewaySettings (flags, the YAML `gateway:` section) and parse_args
  app.py                create_app(): routes, lifespan of the backend pool, disconnect -> cancel
  auth.py               bearer-token check for /v1/* (constant time)
  observability.py      limits (body size, concurrency, n), Prometheus /metrics, per-request JSON log lines
  backends.py           grpc.aio channels, model discovery, health, round-robin + failover on UNAVAILABLE
  request_models.py     chat and completions request bodies with the spec's bounds (extra fields forbidden)
  request_parsing.py    body bytes -> model, or a 400 naming the offending field
  proto_mapping.py      shared request fields -> SamplingParams / StoppingCriteria
  chat.py               /v1/chat/completions (JSON and SSE)
  completions.py        /v1/completions (JSON and SSE; batched/token-id prompts, echo, best_of)
  completion_objects.py the bodies chat, completions, /v1/models and errors answer with; OpenAIObject
  responses.py          /v1/responses (the Responses API): request -> proto, the endpoint
  responses_request.py  its request body, and the 400s for what this server cannot do
  responses_answer.py   one answer: backend messages -> the Response object
  responses_objects.py  the Response object, its output items and usage
  responses_events.py   its stream events and their order
  backend_messages.py   backend messages -> per-sample results, finish reasons
  tools.py              function tools: rendering, forced-call grammars, parsing calls from the output
  structured.py         response_format / text.format -> guided decoding
  logprobs.py           raw token bytes -> chat and legacy logprob JSON (docs/http-api.md, "Logprob rules")
  openapi.py            the /openapi.json document
  errors.py             the OpenAI error shape and the gRPC status -> HTTP mapping
  sse.py                SSE framing
"""
