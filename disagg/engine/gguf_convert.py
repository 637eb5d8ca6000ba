"""GGUF file -> a cached, dequantized Hugging Face directory (config.json, model.safetensors, tokenizer).

Dequantizing with the `gguf` package alone takes about a second for the default model, while
transformers' GGUF path takes about 14 s; and once the copy is on disk every later load is a
memory-mapped safetensors read. The copy is written to a temp dir and renamed into place, so a
reader never sees half a cache entry even when two processes convert the same file at once.
"""

from __future__ import annotations

import functools

import errno
import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator

import numpy as np
import torch
from tqdm import tqdm

from disagg.engine.gguf_archs import ARCHS, window_fields
from disagg.engine.model_config import ModelConfig
from disagg.engine.models import checkpoint_weight_shapes
from disagg.errors import ModelLoadError

# Bump when the conversion changes, so that old cache entries are not reused.
CACHE_FORMAT_VERSION = 2
SUPPORTED_ARCHITECTURES = tuple(ARCHS)

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SKIPPED = ("rope_freqs.weight",)  # llama3 rope factors: folded into config.rope_scaling instead
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def cached_hf_dir(gguf_path: str, cache_dir: str) -> str:
    """The HF directory converted from `gguf_path`, converting it on first use."""
    key = cache_key(gguf_path)
    parent = os.path.join(os.path.expanduser(cache_dir), "gguf")
    final = os.path.join(parent, key)
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{key}.", dir=parent)
    except OSError as exc:
        raise ModelLoadError(f"cache_dir {cache_dir}: cannot create {parent} for the converted GGUF: {exc}") from exc
    try:
        convert_gguf(gguf_path, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache entry should not be
        _rename_into_place(tmp, final)
    except OSError as exc:  # e.g. the disk filled up while writing the copy
        raise ModelLoadError(f"{gguf_path}: cannot write its converted copy under {parent}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def cache_key(gguf_path: str) -> str:
    """Changes when the file is replaced or touched, so a stale copy is never used."""
    path = os.path.realpath(gguf_path)
    st = os.stat(path)
    digest = hashlib.sha256(f"{CACHE_FORMAT_VERSION}|{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(path))[0]
    return f"{stem}-{digest}"


def _rename_into_place(tmp: str, final: str) -> None:
    try:
        os.rename(tmp, final)
    except OSError as exc:
        # Another process finished the same conversion first: its copy is as good as ours.
        lost_race = exc.errno in (errno.EEXIST, errno.ENOTEMPTY) and os.path.isfile(os.path.join(final, "config.json"))
        if not lost_race:
            raise


def convert_gguf(gguf_path: str, out_dir: str) -> ModelConfig:
    """Write config.json, model.safetensors and (if the file has one) the tokenizer to out_dir."""
    reader = open_gguf(gguf_path)
    config = gguf_model_config(reader, gguf_path)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config.to_hf_dict(), f, indent=2)
    tensors = [t for t in reader.tensors if t.name not in _SKIPPED]
    arch = ARCHS[_meta(reader, gguf_path, "general.architecture")]
    plan = [
        (_hf_name(t.name, arch, gguf_path), _output_dtype(t), tuple(int(d) for d in reversed(t.shape.tolist())))
        for t in tensors
    ]
    _check_plan(plan, config, gguf_path)
    weights = ((name, _to_hf_tensor(t, name, config, arch, gguf_path)) for t, (name, _, _) in zip(tensors, plan))
    write_safetensors(
        os.path.join(out_dir, "model.safetensors"),
        plan,
        tqdm(weights, total=len(plan), desc="Dequantizing GGUF", unit="tensor", disable=None, leave=False),
    )
    _save_tokenizer(reader, gguf_path, out_dir)
    return config


def _check_plan(plan, config: ModelConfig, path: str) -> None:
    """Name the GGUF (not the cache copy) when its tensors do not fit its own metadata."""
    shapes = {name: shape for name, _, shape in plan}
    for name, shape in checkpoint_weight_shapes(config, shapes):
        if name not in shapes:
            raise ModelLoadError(f"{path}: lacks the tensor that becomes {name}")
        if shapes[name] != shape:
            raise ModelLoadError(
                f"{path}: the tensor that becomes {name} has shape {shapes[name]}, the metadata implies {shape}"
            )


def open_gguf(path: str):
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader fails in many ways on a bad file (ValueError, IndexError, ...)
        raise ModelLoadError(
            f"{path}: not a readable GGUF file (truncated or corrupt?): {type(exc).__name__}: {exc}"
        ) from exc
    if reader.byte_order != "I":
        raise ModelLoadError(f"{path}: big-endian GGUF files are not supported")
    return reader


# ---- metadata -> ModelConfig ---------------------------------------------------------------------
def gguf_model_config(reader, path: str) -> ModelConfig:
    arch = _meta(reader, path, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: general.architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor")
    shape = _shape_fields(reader, path, arch, tensors)
    meta = functools.partial(_meta, reader, path)
    try:
        family = {**ARCHS[arch].fields(arch, meta, shape), **window_fields(arch, meta, shape["num_hidden_layers"])}
        return ModelConfig(**{**shape, **family})
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def _shape_fields(reader, path: str, arch: str, tensors: dict) -> dict:
    """The ModelConfig fields every architecture's metadata holds alike."""
    hidden = int(_meta(reader, path, f"{arch}.embedding_length"))
    heads = int(_meta(reader, path, f"{arch}.attention.head_count"))
    head_dim = int(_meta(reader, path, f"{arch}.attention.key_length", hidden // heads))
    rope_theta = _f32(_meta(reader, path, f"{arch}.rope.freq_base", 10000.0))
    eos = _meta(reader, path, "tokenizer.ggml.eos_token_id", None)
    return dict(
        architecture=ARCHS[arch].model_type,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # ggml order: (hidden, vocab)
        hidden_size=hidden,
        intermediate_size=int(_meta(reader, path, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_meta(reader, path, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_meta(reader, path, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(_meta(reader, path, f"{arch}.context_length")),
        rms_norm_eps=_f32(_meta(reader, path, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(reader, path, arch, tensors, rope_theta, head_dim),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=_meta(reader, path, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _meta(reader, path: str, key: str, *default):
    field = reader.fields.get(key)
    if field is None:
        if default:
            return default[0]
        raise ModelLoadError(f"{path}: GGUF metadata lacks {key}")
    try:
        return field.contents()
    except Exception as exc:
        raise ModelLoadError(f"{path}: GGUF metadata {key} is unreadable: {exc}") from exc


def _f32(value) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.9999997e-06; keep the value it meant."""
    return float(str(np.float32(value)))


def _rope_scaling(reader, path, arch, tensors, rope_theta, head_dim) -> dict | None:
    if "rope_freqs.weight" in tensors:
        factors = torch.from_numpy(np.array(tensors["rope_freqs.weight"].data, dtype=np.float32))
        return llama3_scaling_from_factors(factors, rope_theta, head_dim, path)
    kind = _meta(reader, path, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = _f32(_meta(reader, path, f"{arch}.rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = int(_meta(reader, path, f"{arch}.rope.scaling.original_context_length"))
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise ModelLoadError(f"{path}: {arch}.rope.scaling.type {kind!r} is not supported (none, linear, llama3, yarn)")


def llama3_scaling_from_factors(factors: torch.Tensor, rope_theta: float, head_dim: int, path: str = "") -> dict:
    """Recover HF's llama3 rope_scaling from the per-frequency factors llama.cpp stores.

    The file keeps only the factors; Llama 3.1/3.2 all use low 1, high 4, original 8192, so we
    rebuild the factors from those and accept them only if they match.
    """
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not torch.allclose(llama3_factors(scaling, rope_theta, head_dim), factors, rtol=1e-4):
        raise ModelLoadError(f"{path}: rope_freqs.weight does not match llama3 rope scaling with the usual parameters")
    return scaling


def llama3_factors(scaling: dict, rope_theta: float, head_dim: int) -> torch.Tensor:
    """The factors llama.cpp's converter writes for a llama3 rope_scaling (its formula)."""
    freqs = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


# ---- tensors -------------------------------------------------------------------------------------
def _hf_name(gguf_name: str, arch, path: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    hf = None
    if base.startswith("blk."):
        _, index, part = base.split(".", 2)
        if part in arch.layer_names and index.isdigit():
            hf = f"model.layers.{index}.{arch.layer_names[part]}"
    else:
        hf = _TOP_NAMES.get(base)
    if hf is None or suffix not in ("weight", "bias"):
        raise ModelLoadError(f"{path}: unexpected tensor {gguf_name!r} for a {arch.model_type} model")
    return f"{hf}.{suffix}"


@functools.lru_cache(maxsize=8)
def gguf_tensor_types(gguf_path: str) -> dict[str, str]:
    """Hugging Face tensor name -> the GGUF type it is stored as ("Q4_1", "Q8_0", "F32", ...):
    how the engine keeps each weight quantized (EngineConfig.weights = "auto")."""
    reader = open_gguf(gguf_path)
    arch = ARCHS.get(_meta(reader, gguf_path, "general.architecture"), ARCHS["llama"])
    return {_hf_name(t.name, arch, gguf_path): t.tensor_type.name for t in reader.tensors if t.name not in _SKIPPED}


def _output_dtype(t) -> torch.dtype:
    import gguf

    # F16/BF16 stay as they are (exact, half the size); every quantized type becomes float32.
    return {gguf.GGMLQuantizationType.F16: torch.float16, gguf.GGMLQuantizationType.BF16: torch.bfloat16}.get(
        t.tensor_type, torch.float32
    )


def _to_hf_tensor(t, hf_name: str, config: ModelConfig, arch, path: str) -> torch.Tensor:
    tensor = _dequantize(t, path).reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
    if arch.permuted_qk and (".q_proj." in hf_name or ".k_proj." in hf_name):
        heads = config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
        tensor = unpermute_rotary(tensor, heads)
    if arch.norm_offset and hf_name.endswith("norm.weight"):
        tensor = tensor - arch.norm_offset
    return tensor


def _dequantize(t, path: str) -> torch.Tensor:
    import gguf

    kind = gguf.GGMLQuantizationType
    try:
        if t.tensor_type in (kind.F32, kind.F16):
            return torch.from_numpy(np.array(t.data))  # copy: the memmap is read-only
        if t.tensor_type == kind.BF16:
            return torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
    except NotImplementedError as exc:
        raise ModelLoadError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}") from exc
    except Exception as exc:
        raise ModelLoadError(
            f"{path}: tensor {t.name} ({t.tensor_type.name}) cannot be dequantized (corrupt file?): {exc}"
        ) from exc


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation, giving Hugging Face's layout.

    HF's rotary embedding (rotate_half) pairs row j of a head with row j + head_dim/2; llama.cpp's
    pairs adjacent rows 2j, 2j+1. Its converter therefore views each head's rows as (2, head_dim/2)
    and transposes them to (head_dim/2, 2): new row 2j+s = old row s*head_dim/2 + j. The inverse
    views the rows as (head_dim/2, 2) and transposes back.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def write_safetensors(
    path: str, plan: list[tuple[str, torch.dtype, tuple[int, ...]]], tensors: Iterator[tuple[str, torch.Tensor]]
) -> None:
    """Stream tensors into one safetensors file, holding one tensor in memory at a time.

    safetensors' own writer wants every tensor at once (the whole dequantized model); the format
    is just a JSON header of (dtype, shape, offsets) then raw bytes, so we write it ourselves.
    """
    header, offset = {}, 0
    for name, dtype, shape in plan:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keeps the data 8-byte aligned, as safetensors does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for (name, tensor), (want_name, dtype, shape) in zip(tensors, plan, strict=True):
            if name != want_name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise ModelLoadError(
                    f"{path}: internal error writing {name}: got {tensor.dtype} {tuple(tensor.shape)}, planned {dtype} {shape}"
                )
            f.write(tensor.contiguous().view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())  # the rename that publishes this entry must not outrun the data


# ---- tokenizer -----------------------------------------------------------------------------------
def _save_tokenizer(reader, gguf_path: str, out_dir: str) -> None:
    if "tokenizer.ggml.model" not in reader.fields:
        return  # a GGUF without a tokenizer: the source then has none
    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:
        raise ModelLoadError(f"{gguf_path}: cannot build a tokenizer from tokenizer.ggml.*: {exc}") from exc
    template = _meta(reader, gguf_path, "tokenizer.chat_template", None)
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    tokenizer.save_pretrained(out_dir)
    _check_saved_tokenizer(tokenizer, out_dir, gguf_path)


def _check_saved_tokenizer(tokenizer, out_dir: str, gguf_path: str) -> None:
    """The loader reads the copy back as a plain PreTrainedTokenizerFast; it must encode the same."""
    from transformers import PreTrainedTokenizerFast

    probe = "Hello world! Ça va? 🙂 中文 1234"
    saved = PreTrainedTokenizerFast.from_pretrained(out_dir)
    if saved.encode(probe) != tokenizer.encode(probe):
        raise ModelLoadError(
            f"{gguf_path}: its tokenizer does not survive conversion ({type(tokenizer).__name__} encodes differently once saved)"
        )
