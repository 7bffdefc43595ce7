"""Every parser of bytes that come from Redis, ZeroMQ or a file, in one place (the fuzz tests in
``tests/test_fuzz.py`` aim here, through the codec and the records that use them):

* `broker.untrusted.schema`: msgpack documents scanned against a schema before msgpack builds
  anything (the wire codec's payloads, headers and snapshots, the syncer state, archives);
* `broker.untrusted.values`: values of Redis records (bounded text, finite numbers, integers in
  range), JSON bounded before the parser runs, and record dataclasses checked field by field.

The size limits every parser shares (dimensions, names, tensors, fragments) are in
`pipeline.limits`.
"""

from broker.untrusted.schema import (
    M_INT,
    M_NIL,
    M_NUM,
    MBin,
    MDict,
    MList,
    MMap,
    MOneOf,
    MScalar,
    MsgSchema,
    MStr,
    MTuple,
    Scan,
    as_buffer,
    build_scanned,
    check_blob,
    scan_checked,
    short_repr,
    unpack_checked,
)
from broker.untrusted.values import bounded_json, bounded_text, finite_number, int64, nonneg_int

__all__ = ["M_INT", "M_NIL", "M_NUM", "MBin", "MDict", "MList", "MMap", "MOneOf", "MScalar",
           "MsgSchema", "MStr", "MTuple", "Scan", "as_buffer", "build_scanned", "check_blob",
           "scan_checked", "short_repr", "unpack_checked", "bounded_json", "bounded_text",
           "finite_number", "int64", "nonneg_int"]
