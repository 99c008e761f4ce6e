"""Id aliases shared by every room. Plain aliases: they document intent at zero cost."""

ReqId = str
NodeId = str
TokenId = int
BlockId = int
# A block hash is the digest of a chained hash (see core.hashing): 32 bytes for SHA-256,
# 16 bytes for xxh3-128. Bytes compare, hash and pack into msgpack without conversion.
BlockHash = bytes
