"""Generated protobuf and gRPC code for the jaxdist wire format.

The source of truth is ``jaxdist.proto`` beside this file; ``scripts/gen_proto.py`` makes the
``*_pb2*.py`` files. Never edit them by hand.
"""
