"""The any-language target protocol: JSON lines between the kit and a target program.

* ``codec``: the model's values as JSON and back, one function per kind of value;
* ``server``: any Python target served over stdin and stdout;
* ``schemas/``: the protocol's JSON Schema.

``python -m kvpool.specs.protocol TARGET`` serves a target. docs/formats.md
describes the protocol.
"""

from kvpool.specs.pool.target import PROTOCOL_OPERATIONS as OPERATIONS
from kvpool.specs.protocol.codec import (
    ERROR_NAMES,
    PROTOCOL_VERSION,
    Json,
    ProtocolError,
    apply,
    check_result,
    decode_config,
    decode_event,
    decode_hash,
    decode_key,
    decode_request,
    decode_result,
    decode_state,
    encode_args,
    encode_config,
    encode_event,
    encode_hash,
    encode_key,
    encode_request,
    encode_result,
    encode_state,
    error_class,
)
from kvpool.specs.protocol.server import Server, hello_result, serve

__all__ = [
    "ERROR_NAMES",
    "OPERATIONS",
    "PROTOCOL_VERSION",
    "Json",
    "ProtocolError",
    "Server",
    "apply",
    "check_result",
    "decode_config",
    "decode_event",
    "decode_hash",
    "decode_key",
    "decode_request",
    "decode_result",
    "decode_state",
    "encode_args",
    "encode_config",
    "encode_event",
    "encode_hash",
    "encode_key",
    "encode_request",
    "encode_result",
    "encode_state",
    "error_class",
    "hello_result",
    "serve",
]
