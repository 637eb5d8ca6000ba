"""Generated protobuf/gRPC stubs of the public API (proto/disagg/v1/serving.proto).

Do not edit the *_pb2* files by hand: `python proto/generate.py` rebuilds them.
"""
