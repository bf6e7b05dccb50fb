"""The wire: what a contribution looks like on its way to the others.

- `compress`: the formats (`COMM_DTYPES`: fp32, 16-bit, int8/fp8/int4/fp4, top-k), the wire
  buffers, error feedback;
- `quantize`: block-scaled low-bit codecs and their gathered wire;
- `sparse`: top-k messages and their gathered wire.
"""
