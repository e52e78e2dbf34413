"""The CPU engines a user would pick instead of kvgen (CTranslate2, OpenVINO GenAI, ONNX Runtime
GenAI): each model's exports and a runner per engine, for benchmarks/decode.py. Benchmarks only."""
