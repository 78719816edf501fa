"""A checkpoint directory's files, checked, not trusted: ``config.json``, the safetensors
index and weight files, the tokenizer's ``eos_token``.

Every file must be a regular file (checked with ``os.stat`` before it is opened: a FIFO, a
device or a directory is refused unread); the index's ``weight_map`` must name plain file
names inside the directory; a damaged safetensors file (truncated, bad header, offsets past
the end) is named; every slice read is checked finite. Each fault is a one-line
``ValueError`` naming the file (and the tensor or field). Weight files are written by
:func:`save_safetensors`, with the permissions of any other new file.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from jaxmp.models.hf.spec import non_finite, short

__all__ = ["Files", "read_config", "check_directory", "tokenizer_eos", "safetensors_module",
           "save_safetensors",
           "regular_file", "read_json", "all_finite", "is_config_file", "one_line",
           "first_names", "INDEX", "SINGLE", "FLOAT_DTYPES", "SKIPPED"]


def save_safetensors(tensors, file: str, metadata: Dict[str, str]) -> None:
    """``safetensors.numpy.save_file``, the file then given the permissions ``open()``
    gives a new file here (the umask's): safetensors' writer creates it readable by its
    owner alone (0600, measured with safetensors 0.8), which a serving process of another
    user cannot read, beside a config.json it can.

    Raises:
      ImportError: as :func:`safetensors_module`.
      OSError: the write or the chmod failed.
    """
    safetensors_module().numpy.save_file(tensors, file, metadata=metadata)
    probe = f"{file}.mode-{os.getpid()}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
        os.remove(probe)
    os.chmod(file, mode)


def safetensors_module():
    """The ``safetensors`` package (in the ``train`` extra, not in jaxmp's core install).

    Raises:
      ImportError: it is not installed (one line naming the extra).
    """
    try:
        import safetensors
        import safetensors.numpy  # noqa: F401
    except ImportError:
        raise ImportError("Hugging Face checkpoints (jaxmp.models.from_pretrained, "
                          "save_pretrained) need safetensors: pip install 'jaxmp[train]' "
                          "(or pip install safetensors)") from None
    return safetensors


INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# The dtypes a weight may be stored in (safetensors' names): floating point, not FP8
# (FP8 checkpoints come with a quantization_config, which jaxmp does not read).
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# Tensors a checkpoint may hold that jaxmp does not read, on purpose: RoPE's inverse
# frequencies, a buffer older transformers saved (jaxmp computes them from rope_theta).
SKIPPED = re.compile(r"(.+\.)?rotary_emb\.inv_freq")


def one_line(e: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(e).split()) or type(e).__name__


def first_names(names: List[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def regular_file(file: str, what: str, missing_ok: bool = False) -> bool:
    """Whether ``file`` is a regular file (after symbolic links), checked with ``os.stat``
    alone: a FIFO, a device or a directory is refused without being opened (opening a
    FIFO for reading blocks). False when nothing is there and ``missing_ok``.

    Raises:
      ValueError: ``file`` is not a regular file, is missing (unless ``missing_ok``) or a
        broken symbolic link (one line naming it and ``what`` it should be).
    """
    try:
        mode = os.stat(file).st_mode
    except FileNotFoundError:
        if os.path.islink(file):
            raise ValueError(f"{file}: a broken symbolic link; the checkpoint's {what} must "
                             f"be a regular file") from None
        if missing_ok:
            return False
        raise ValueError(f"{file}: no such file; the checkpoint's {what} must be a regular "
                         f"file") from None
    except OSError as e:
        raise ValueError(f"{file}: cannot read the checkpoint's {what} "
                         f"({one_line(e)})") from None
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a character device" if stat.S_ISCHR(mode) else "a block device"
                if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "special")
        raise ValueError(f"{file}: {kind}, not a regular file; the checkpoint's {what} must "
                         f"be a regular file (refused unread)")
    return True


def json_kind(data: Any) -> str:
    return ("null" if data is None else "a JSON array" if isinstance(data, list) else
            "a string" if isinstance(data, str) else "a boolean" if isinstance(data, bool)
            else f"the number {data!r}" if isinstance(data, (int, float)) else
            type(data).__name__)


def read_json(file: str, what: str, finite: bool = True) -> Dict[str, Any]:
    """The JSON object in regular file ``file`` (the checkpoint's ``what``).

    Raises:
      ValueError: not a regular file, not JSON, not an object, or (``finite``) a
        non-finite number anywhere (one line naming the file and, for a number, the key).
    """
    regular_file(file, what)
    try:
        with open(file, "rb") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSON, UTF-8
        raise ValueError(f"{file}: cannot read the checkpoint's {what} "
                         f"({one_line(e)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: the checkpoint's {what} is {json_kind(data)}; allowed: a "
                         f"JSON object {{...}}")
    bad = non_finite(data) if finite else None
    if bad is not None:
        raise ValueError(f"{file}: {bad[0]}={bad[1]!r} is not a finite number; allowed: "
                         f"finite numbers only")
    return data


def plain_name(directory: str, name: Any) -> bool:
    """``name`` is a plain file name inside ``directory``: no path separator, not ``..``,
    not absolute, lexically inside the directory once joined."""
    if not isinstance(name, str) or name in ("", ".", "..") or "\x00" in name:
        return False
    if any(sep and sep in name for sep in ("/", "\\", os.sep, os.altsep)):
        return False
    if os.path.isabs(name):
        return False
    joined = os.path.abspath(os.path.join(directory, name))
    return os.path.dirname(joined) == os.path.abspath(directory)


class Files:
    """The checkpoint's tensors by name over its (possibly sharded) safetensors files.

    Nothing is taken on trust: the index must map tensor names to plain file names inside
    the directory, every file must be a regular file (checked before it is opened) and a
    readable safetensors file, a shard must hold only the tensors the index maps to it,
    and every slice read must be finite. Each fault is a one-line ``ValueError`` naming
    the file (and the tensor).
    """

    def __init__(self, path: str):
        self.path, self._safe_open = path, safetensors_module().safe_open
        self._headers: Dict[str, Dict[str, Tuple[Tuple[int, ...], str]]] = {}
        self._real: Dict[str, str] = {}  # our name -> the file's (take_text_model)
        # name -> {its blocks' and scales' names: their files} (take_mxfp4)
        self._mxfp4: Dict[str, Dict[str, str]] = {}
        # weight -> (its scale's name and file, the block [rows, cols]) (take_fp8)
        self._fp8: Dict[str, Tuple[str, str, Tuple[int, int]]] = {}
        self._offsets: Dict[str, Tuple[int, Dict[str, Any]]] = {}  # file -> its header (FP8)
        index = os.path.join(path, INDEX)
        if regular_file(index, INDEX, missing_ok=True):
            weight_map = read_json(index, INDEX).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: weight_map={short(weight_map)} is not allowed; "
                                 f"allowed: a JSON object {{tensor name: file name}}")
            for name, file in weight_map.items():
                if not plain_name(path, file):
                    raise ValueError(f"{index}: weight_map[{name!r}]={short(file)} is not a "
                                     f"file inside the checkpoint directory; allowed: a plain "
                                     f"file name (no path separator, not '..')")
            self.indexed, self.weight_map = True, weight_map
            self._index = dict(weight_map)  # as the index says, whatever take_text_model keeps
        elif regular_file(os.path.join(path, SINGLE), SINGLE, missing_ok=True):
            self.indexed, self.weight_map = False, {}
            self.weight_map = dict.fromkeys(self._header(SINGLE), SINGLE)
            self._index = dict(self.weight_map)
        else:
            raise ValueError(f"{path}: neither model.safetensors nor "
                             f"model.safetensors.index.json found")

    def take_text_model(self, prefixes) -> List[str]:
        """Names a wrapper's text-model tensors as a text checkpoint's (``model.*``,
        ``lm_head.weight``) and leaves out the rest; returns the names left out.

        Args:
          prefixes: ``((prefix, head), ...)`` (:attr:`~jaxmp.models.hf.spec.Family.text_prefixes`):
            the first whose prefix names some tensor is the checkpoint's; a head under any
            of the namings is the head (transformers renames the old one), checked as any
            stored head is.

        Raises:
          ValueError: no tensor is named under any of the prefixes, or two heads are stored.
        """
        for prefix, head in prefixes:
            if any(n.startswith(prefix) for n in self.weight_map):
                break
        else:
            raise ValueError(f"{self.path}: no tensor of the text model (named "
                             f"{' or '.join(p + '...' for p, _ in prefixes)})")
        heads = [h for _, h in prefixes if h in self.weight_map]
        if len(heads) > 1:  # transformers would read one of them: which is not said
            raise ValueError(f"{self.path}: the checkpoint stores the text model's head twice "
                             f"({', '.join(heads)}); allowed: one")
        kept, left = {}, []
        for name, file in self.weight_map.items():
            ours = ("model." + name[len(prefix):] if name.startswith(prefix) else
                    "lm_head.weight" if name in heads else None)  # either naming's head
            if ours is None:
                left.append(name)
            else:
                kept[ours], self._real[ours] = file, name
        self.weight_map = kept
        return sorted(left)

    def take_mxfp4(self) -> List[str]:
        """Names each MXFP4 pair ``X_blocks`` / ``X_scales`` as one tensor ``X`` read
        dequantized (GPT-OSS's released experts, ``quant_method: mxfp4``); returns the
        names taken.

        The OCP Microscaling format (MX v1.0): ``X_blocks`` uint8 ``[..., R, G, 16]`` holds
        two E2M1 values a byte (the low nibble first), ``X_scales`` uint8 ``[..., R, G]``
        one E8M0 exponent (bias 127) per block of 32. ``X`` is ``[..., G * 32, R]``, the
        transpose of the blocks' rows, as transformers' ``convert_moe_packed_tensors``
        lays it out (``gate_up_proj [E, d, 2I]``), read in float32: every E2M1 value times
        a power of two is exact there.
        """
        taken = []
        for name in sorted(self.weight_map):
            base = name[:-len("_blocks")]
            if name.endswith("_blocks") and f"{base}_scales" in self.weight_map:
                taken.append(base)
        for base in taken:
            parts = (f"{base}_blocks", f"{base}_scales")
            self._mxfp4[base] = {n: self.weight_map.pop(n) for n in parts}
            self.weight_map[base] = self._mxfp4[base][parts[0]]
        return taken

    def take_fp8(self, block: Tuple[int, int]) -> List[str]:
        """Names each FP8 weight with its ``weight_scale_inv`` as one tensor read
        dequantized (DeepSeek-V3's, Qwen3's and GLM-4.5's released FP8 checkpoints,
        ``quant_method: fp8``); returns the names taken.

        ``X.weight`` E4M3 ``[out, in]`` and ``X.weight_scale_inv`` ``[ceil(out / b0),
        ceil(in / b1)]`` (``block = (b0, b1)``, ``weight_block_size``) are ``X.weight``
        float32 ``[out, in]``, each element times its block's scale, in float32 (as
        transformers' ``_dequantize_fp8_weight`` computes it: one rounding of the product).
        The blocks are ``weight_block_size``'s, the last ones partial where it does not
        divide a dimension (DeepSeek's ``weight_dequant``); transformers' CPU loader takes
        the block from the scale grid instead (``rows // grid_rows``), which differs there
        (48 rows in blocks of 32: jaxmp 32 + 16, transformers 24 + 24).
        Shapes and dtypes are checked by :meth:`info`, the scales as they are read.
        """
        taken = []
        for name in sorted(self.weight_map):
            scale = f"{name}_scale_inv"
            if name.endswith(".weight") and scale in self.weight_map:
                self._fp8[name] = (scale, self.weight_map.pop(scale), tuple(block))
                taken.append(name)
        return taken

    def _fp8_scale(self, name: str):
        """Inside, the scale of FP8 weight ``name`` is a tensor of its own."""
        scale, file, _ = self._fp8[name]
        return self._parts_of(name, {scale: file})

    @contextlib.contextmanager
    def _parts_of(self, name: str, parts=None):
        """Inside, the blocks and scales of MXFP4 tensor ``name`` are tensors of their own
        (for :meth:`info` and :meth:`read`); ``parts``: ``{name: file}`` of other parts."""
        parts = self._mxfp4[name] if parts is None else parts
        self.weight_map.update(parts)
        try:
            yield tuple(parts)
        finally:
            for n in parts:
                del self.weight_map[n]

    def _mxfp4_parts(self, name: str):
        """``(blocks, scales)`` names of MXFP4 tensor ``name`` with their headers checked:
        uint8 ``[..., R, G, 16]`` and ``[..., R, G]``."""
        with self._parts_of(name) as (blocks, scales):
            (bshape, bdtype), (sshape, sdtype) = self.info(blocks), self.info(scales)
        if bdtype != "U8" or sdtype != "U8" or len(bshape) < 3 or bshape[-1] != 16 or \
                tuple(bshape[:-1]) != tuple(sshape):
            raise ValueError(f"{self.path}: MXFP4 tensor {name}: {blocks} {list(bshape)} "
                             f"{bdtype} and {scales} {list(sshape)} {sdtype}; allowed: uint8 "
                             f"[..., R, G, 16] blocks and uint8 [..., R, G] scales")
        return blocks, scales, tuple(bshape)

    def real_name(self, name: str) -> str:
        """The tensor's name in its file (a wrapper's text model is read under another)."""
        return self._real.get(name, name)

    def _header(self, file: str) -> Dict[str, Tuple[Tuple[int, ...], str]]:
        """``{tensor: (shape, dtype)}`` of weight file ``file`` (its header, read once)."""
        if file not in self._headers:
            full = os.path.join(self.path, file)
            regular_file(full, "weight file")
            try:
                header = {}
                with self._safe_open(full, "np") as f:
                    for k in f.keys():
                        sl = f.get_slice(k)
                        header[k] = (tuple(sl.get_shape()), sl.get_dtype())
            except Exception as e:  # noqa: BLE001  SafetensorError, OSError: damaged
                raise ValueError(f"{full}: not a readable safetensors file "
                                 f"({one_line(e)})") from None
            if self.indexed:
                extra = sorted(k for k in header if self._index.get(k) != file)
                if extra:
                    raise ValueError(f"{full}: holds {len(extra)} tensor(s) that {INDEX} "
                                     f"does not map to it: {first_names(extra)}")
            self._headers[file] = header
        return self._headers[file]

    def info(self, name: str) -> Tuple[Tuple[int, ...], str]:
        """The tensor's ``(shape, dtype)``, from its file's header (``"MXFP4"`` and the
        dequantized shape for a tensor :meth:`take_mxfp4` took)."""
        if name not in self.weight_map:
            raise ValueError(f"{self.path}: the checkpoint has no tensor {name!r}")
        if name in self._mxfp4:
            *prefix, rows, groups, _ = self._mxfp4_parts(name)[2]
            return tuple(prefix) + (groups * 32, rows), "MXFP4"
        if name in self._fp8:
            return self._fp8_info(name)
        return self._stored_info(name)

    def _stored_info(self, name: str) -> Tuple[Tuple[int, ...], str]:
        """``(shape, dtype)`` of tensor ``name`` as its file's header says (an FP8 weight's
        own, E4M3)."""
        file = self.weight_map[name]
        header = self._header(file)
        if self.real_name(name) not in header:
            raise ValueError(f"{self.path}: {file} has no tensor {self.real_name(name)!r} "
                             f"(the index says it has)")
        return header[self.real_name(name)]

    def shape(self, name: str) -> Tuple[int, ...]:
        """The tensor's shape, from its file's header (each file's header is read once)."""
        return self.info(name)[0]

    def read(self, name: str, index) -> np.ndarray:
        """``tensor[index]`` read from a mapping of its file opened for this read only
        (when it closes the file is unmapped, so the pages read do not stay in the
        process's resident memory: a cached handle kept the whole checkpoint's pages
        resident, benchmarks/hf_load_memory.py).

        Raises:
          ValueError: the read fails, or the slice holds a NaN or an infinity (naming the
            tensor and its file).
        """
        if name not in self.weight_map:
            raise ValueError(f"{self.path}: the checkpoint has no tensor {name!r}")
        if name in self._mxfp4:
            return self._read_mxfp4(name, index)
        if name in self._fp8:
            return self._read_fp8(name, index)
        file = os.path.join(self.path, self.weight_map[name])
        try:
            with self._safe_open(file, "np") as f:
                x = np.asarray(f.get_slice(self.real_name(name))[index])
        except Exception as e:  # noqa: BLE001  SafetensorError, OSError
            raise ValueError(f"{file}: cannot read tensor {name} ({one_line(e)})") from None
        if not all_finite(x):
            raise ValueError(f"{file}: tensor {name} holds non-finite values (NaN or "
                             f"infinity); allowed: finite weights")
        return x

    def _read_mxfp4(self, name: str, index) -> np.ndarray:
        """``X[index]`` of MXFP4 tensor ``X`` (:meth:`take_mxfp4`), float32: the rows of
        the index's prefix and last axis, every block, dequantized, transposed, then cut to
        the index's second-to-last axis."""
        blocks, scales, shape = self._mxfp4_parts(name)
        *prefix, cols, rows = _full_index(index, len(shape) - 1)
        stored = tuple(prefix) + (rows,)
        with self._parts_of(name):
            b = self.read(blocks, stored).astype(np.uint8)
            e = self.read(scales, stored).astype(np.int32) - 127
        values = np.empty(b.shape[:-1] + (32,), np.float32)
        values[..., 0::2], values[..., 1::2] = E2M1[b & 0x0F], E2M1[b >> 4]
        with np.errstate(over="ignore"):
            x = np.ldexp(values, e[..., None]).reshape(b.shape[:-2] + (-1,))
        if not all_finite(x):  # E8M0 255 is NaN; a scale past float32's range is inf
            raise ValueError(f"{self.path}: MXFP4 tensor {name} has scales beyond float32's "
                             f"range ({scales} up to {int(e.max()) + 127}); allowed: finite "
                             f"weights")
        return np.swapaxes(x, -1, -2)[..., cols, :]

    def _fp8_info(self, name: str) -> Tuple[Tuple[int, ...], str]:
        """``(shape, "FP8")`` of FP8 weight ``name`` once its header and its scale's are
        checked: E4M3 ``[out, in]`` and a float scale per block."""
        scale, _, (b0, b1) = self._fp8[name]
        shape, dtype = self._stored_info(name)
        with self._fp8_scale(name):
            sshape, sdtype = self.info(scale)
        want = tuple(-(-n // b) for n, b in zip(shape, (b0, b1)))
        if dtype != "F8_E4M3" or len(shape) != 2 or sdtype not in FLOAT_DTYPES or \
                tuple(sshape) != want:
            raise ValueError(f"{self.path}: FP8 weight {name} {list(shape)} {dtype} with "
                             f"{scale} {list(sshape)} {sdtype}; allowed: an F8_E4M3 [out, in] "
                             f"weight and a float scale [ceil(out / {b0}), ceil(in / {b1})] "
                             f"(weight_block_size [{b0}, {b1}])")
        return tuple(shape), "FP8"

    def is_fp8(self, name: str) -> bool:
        """Whether weight ``name`` is stored in E4M3 with block scales (:meth:`take_fp8`)."""
        return name in self._fp8

    def fp8_block(self, name: str) -> Tuple[int, int]:
        """``weight_block_size`` of FP8 weight ``name``."""
        return self._fp8[name][2]

    def read_e4m3(self, name: str, index) -> np.ndarray:
        """``X.weight[index]`` of FP8 weight ``X.weight`` as stored: E4M3 values
        (``ml_dtypes.float8_e4m3fn``), not scaled; what a ``lora.base=fp8`` model keeps.

        Raises:
          ValueError: the read fails, or the slice holds an E4M3 NaN.
        """
        w = self._e4m3(name, index)
        if np.isnan(w.astype(np.float32)).any():
            raise ValueError(f"{os.path.join(self.path, self.weight_map[name])}: FP8 weight "
                             f"{name} holds NaN; allowed: finite weights")
        return w

    def fp8_scales(self, name: str) -> np.ndarray:
        """The float32 block scales ``[ceil(out / b0), ceil(in / b1)]`` of FP8 weight
        ``name`` (its ``weight_scale_inv``), as stored.

        Raises:
          ValueError: a scale that is not finite, not positive, or so large that 448 times
          it overflows float32 (naming the tensor).
        """
        scale = self._fp8[name][0]
        with self._fp8_scale(name):
            s = self.read(scale, slice(None)).astype(np.float32)
        if not np.all(s > 0):
            raise ValueError(f"{os.path.join(self.path, self._fp8[name][1])}: tensor {scale} "
                             f"holds a scale <= 0; allowed: positive scales")
        if not np.all(s <= np.finfo(np.float32).max / 448):
            raise ValueError(f"{os.path.join(self.path, self._fp8[name][1])}: tensor {scale} "
                             f"holds a scale of {float(s.max()):.4g}, past float32's range "
                             f"times E4M3's largest value (448); allowed: scales up to "
                             f"{float(np.finfo(np.float32).max / 448):.4g}")
        return s

    def _e4m3(self, name: str, index) -> np.ndarray:
        """The E4M3 slice of FP8 weight ``name`` read from the file's bytes (NumPy has no
        E4M3 type for safetensors to read into: ml_dtypes', which jax ships, is used)."""
        import ml_dtypes

        shape, _ = self._fp8_info(name)
        rows, cols = (np.arange(n)[i] for n, i in zip(shape, _full_index(index, 2)))
        file = os.path.join(self.path, self.weight_map[name])
        try:
            if file not in self._offsets:  # the header's byte ranges, read once per file
                with open(file, "rb") as f:
                    size = int.from_bytes(f.read(8), "little")
                    self._offsets[file] = 8 + size, json.loads(f.read(size))
            start, header = self._offsets[file]
            begin, end = header[self.real_name(name)]["data_offsets"]
            if end - begin != shape[0] * shape[1]:
                raise ValueError(f"{end - begin} bytes for {shape[0]} x {shape[1]} E4M3 values")
            data = np.memmap(file, np.uint8, "r", offset=start + begin, shape=(end - begin,))
            w = np.array(data.view(ml_dtypes.float8_e4m3fn).reshape(shape)[np.ix_(rows, cols)])
            del data
        except Exception as e:  # noqa: BLE001  OSError, a damaged header
            raise ValueError(f"{file}: cannot read tensor {name} ({one_line(e)})") from None
        return w

    def _read_fp8(self, name: str, index) -> np.ndarray:
        """``X.weight[index]`` of FP8 weight ``X.weight`` (:meth:`take_fp8`), float32:
        the E4M3 slice (:meth:`_e4m3`) times the scales of the blocks it covers."""
        _, _, (b0, b1) = self._fp8[name]
        shape, _ = self._fp8_info(name)
        rows, cols = (np.arange(n)[i] for n, i in zip(shape, _full_index(index, 2)))
        w = self._e4m3(name, index)
        s = self.fp8_scales(name)
        x = w.astype(np.float32) * s[np.ix_(rows // b0, cols // b1)]
        if not all_finite(x):  # an E4M3 NaN, or a product past float32's range
            file = os.path.join(self.path, self.weight_map[name])
            raise ValueError(f"{file}: FP8 weight {name} holds non-finite values (NaN, or "
                             f"beyond float32's range times its scale); allowed: finite weights")
        return x


def _full_index(index, ndim: int) -> tuple:
    """``index`` (an index or a tuple of them) with a ``slice(None)`` for each axis it
    leaves out, ``ndim`` in all."""
    index = index if isinstance(index, tuple) else (index,)
    return index + (slice(None),) * (ndim - len(index))


# The 16 values of an E2M1 nibble (OCP Microscaling v1.0, section 5.3.3), by its bits.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def all_finite(x: np.ndarray) -> bool:
    """No NaN or infinity in ``x``, without an array of its size in memory: the float64
    sum of finite float16/bfloat16/float32 values is finite; only a non-finite sum (or a
    float64 sum that overflows) is looked at element by element."""
    with np.errstate(over="ignore", invalid="ignore"):
        if x.size == 0 or math.isfinite(float(x.sum(dtype=np.float64))):
            return True
    return bool(np.isfinite(x).all())




def read_config(path: str) -> Dict[str, Any]:
    """The parsed ``config.json`` of checkpoint directory ``path`` (its fields are
    checked by :func:`config_from_hf`). ``path`` may also name the ``.json`` file itself
    (a released model's config.json alone, as in ``configs/hf/``): enough to plan a run
    (``python -m jaxmp.report``), not to load weights (:func:`check_weights` refuses it).

    Raises:
      ValueError: one line naming the file: no ``config.json`` there, or not a regular
        file (a FIFO, a device or a directory: refused without being opened), not JSON,
        not a JSON object, or holding a non-finite number (NaN, Infinity; the key named).
    """
    file = path if is_config_file(path) else os.path.join(path, "config.json")
    return read_json(file, "config.json")


def is_config_file(path: str) -> bool:
    """``path`` names a config.json file rather than a checkpoint directory: it is not a
    directory and its name ends in ``.json``."""
    return str(path).endswith(".json") and not os.path.isdir(path)


def check_directory(path: str) -> None:
    """Refuses a ``path`` that is not a directory, e.g. a config.json file, which
    :func:`read_config` reads to plan a run but which holds no weights.

    Raises:
      ValueError: one line naming ``path``.
    """
    if is_config_file(path) or not os.path.isdir(path):
        raise ValueError(f"{path}: not a checkpoint directory; a config.json alone plans a run "
                         f"(python -m jaxmp.report) but loading needs the directory with its "
                         f"config.json and safetensors weights")


def tokenizer_eos(path: str) -> Optional[Tuple[str, int]]:
    """``(tokenizer.json path, eos id)`` of a checkpoint directory, or None without a
    ``tokenizer.json`` (or when ``path`` is a config.json file, :func:`read_config`). The
    id is that of ``tokenizer_config.json``'s ``eos_token``, looked up in the tokenizer
    (None when there is no such file or token: the tokenizer's own
    choice, :data:`jaxmp.train.tokenizer.EOS_CANDIDATES`).

    Raises:
      ValueError: an ``eos_token`` that the tokenizer does not have, or either file not a
        regular file (refused unopened), a ``tokenizer.json`` that does not load, or a
        ``tokenizer_config.json`` that is not a JSON object or whose ``eos_token`` is
        neither null, a non-empty string nor ``{"content": non-empty string}`` (one line
        naming the file).
    """
    if not os.path.isdir(path):  # a config.json file alone (read_config): no tokenizer
        return None
    file = os.path.join(path, "tokenizer.json")
    if not regular_file(file, "tokenizer.json", missing_ok=True):
        return None
    eos = None
    config = os.path.join(path, "tokenizer_config.json")
    if regular_file(config, "tokenizer_config.json", missing_ok=True):
        eos = read_json(config, "tokenizer_config.json", finite=False).get("eos_token")
    if eos is None:  # absent or null: the tokenizer's own choice
        return file, None
    text = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(text, str) or not text:
        raise ValueError(f"{config}: eos_token={short(eos)} is not allowed; allowed: a "
                         f"non-empty string or {{\"content\": non-empty string}}, or null")
    eos = text
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as e:  # noqa: BLE001  tokenizers raises a bare Exception
        raise ValueError(f"{file}: not a Hugging Face tokenizer.json ({one_line(e)})") from None
    eos_id = tokenizer.token_to_id(eos)
    if eos_id is None:
        raise ValueError(f"{config}: eos_token={eos!r} is not in {file}")
    return file, int(eos_id)
