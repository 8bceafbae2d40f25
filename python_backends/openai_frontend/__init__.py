"""OpenAI-compatible chat API over the mm_qa interface: `zipmoe serve --openai-port N`.

`chat.py` turns a chat request's JSON into mm_qa inputs and the answers back into OpenAI's JSON;
`app.py` is the ASGI app (Starlette) that streams each request through Triton's gRPC stream;
`server.py` runs it under uvicorn beside tritonserver.
"""
