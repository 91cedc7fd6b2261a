"""Write a GGUF file's weights in another block format (Q4_0, Q4_1 or Q8_0), as llama.cpp's
`llama-quantize --allow-requantize` does: every 2-D tensor stored in one of those formats
(or Q4_K/Q6_K, dequantized first) is quantized again from its float32 values; metadata,
tokenizer and the other tensors are copied. For tests and benchmarks that need SmolLM2 in
several formats when only its Q4_1 file ships.

    python -m pagefleet.engine.loader.gguf_requantize SOURCE.gguf TARGET.gguf Q8_0
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

_FORMATS = ("Q4_0", "Q4_1", "Q8_0")
_REQUANTIZED_FROM = {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K"}
# llama.cpp's LLAMA_FTYPE_MOSTLY_* (the `general.file_type` key).
_FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}


def requantize_gguf(source: Path, target: Path, format_name: str) -> None:
    """Write `source` to `target` with its quantized weights in `format_name`; `target`
    appears only once complete."""
    import gguf
    import numpy as np

    if format_name not in _FORMATS:
        raise ValueError(f"format must be one of {', '.join(_FORMATS)}, got {format_name!r}")
    new_type = gguf.GGMLQuantizationType[format_name]
    reader = gguf.GGUFReader(str(source))
    architecture = reader.fields["general.architecture"].contents()
    staging = Path(tempfile.mkstemp(prefix=target.name + ".", dir=target.parent)[1])
    try:
        writer = gguf.GGUFWriter(str(staging), architecture)
        for field in reader.fields.values():
            if field.name == "general.architecture" or field.name.startswith("GGUF."):
                continue  # written by GGUFWriter itself
            value = _FILE_TYPES[format_name] if field.name == "general.file_type" else field.contents()
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
        tensors = []
        for tensor in reader.tensors:
            data, tensor_type = tensor.data, tensor.tensor_type
            if tensor_type.name in _REQUANTIZED_FROM and len(tensor.shape) == 2:
                values = gguf.quants.dequantize(np.asarray(data), tensor_type)
                data, tensor_type = gguf.quants.quantize(values, new_type), new_type
            tensors.append((tensor.name, data, tensor_type))
            writer.add_tensor_info(tensor.name, data.shape, data.dtype, data.nbytes, tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _name, data, _type in tensors:
            writer.write_tensor_data(np.asarray(data))
        writer.close()
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("format", choices=_FORMATS)
    args = parser.parse_args()
    requantize_gguf(args.source, args.target, args.format)


if __name__ == "__main__":
    main()
