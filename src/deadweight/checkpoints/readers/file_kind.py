"""What a file named like a torch checkpoint really is, from its first bytes, with nothing run.

`torch.save` writes a zip archive (torch >= 1.6) or, in the legacy format, a pickle
that starts with a magic number. A `.bin`/`.pt` that is neither is something else: a
raw `pickle.dump`, a safetensors or GGUF file under the wrong name, a Git LFS pointer
left by a clone without LFS, an HTML error page saved by a failed download. The reader
says which, that nothing of the file ran, and what to do, instead of quoting the
unpickler's "Unsupported operand 149".

A raw pickle's imports are listed by walking its opcodes (`pickletools.genops`, which
only parses) over at most `SCAN_BYTES` of it: what loading it would import.
"""

from __future__ import annotations

import io
import pickletools
import zipfile
from dataclasses import dataclass

# Bytes read to tell the kinds apart and to list a pickle's imports: the imports of a
# state dict come first (one per tensor type), and a hostile file cannot make the scan
# read more than this.
SCAN_BYTES = 1 << 20
# Imports named in a message.
MAX_IMPORTS = 6
# The legacy torch.save format's first pickled object: torch.serialization.MAGIC_NUMBER.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LFS = b"version https://git-lfs.github.com/spec/"

_SAFER = (
    "safer: load it once where you trust it and re-save the weights with safetensors "
    "(safetensors.torch.save_file(state_dict, 'model.safetensors'))"
)


@dataclass(frozen=True)
class FileKind:
    kind: str  # "torch-zip", "torch-legacy", "pickle", "zip", "safetensors", ...
    protocol: int | None = None  # a pickle's protocol
    imports: tuple[str, ...] = ()  # what loading a pickle would import
    more_imports: bool = False

    @property
    def is_torch(self) -> bool:
        return self.kind in ("torch-zip", "torch-legacy")


def sniff(path: str) -> FileKind:
    """What `path` is, from its first bytes (and a zip's directory). Never unpickles."""
    with open(path, "rb") as f:
        head = f.read(SCAN_BYTES)
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()[:10_000]
        except (zipfile.BadZipFile, OSError, ValueError):
            names = []
        if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
            return FileKind("torch-zip")
        return FileKind("zip")
    if _legacy_torch(head):
        return FileKind("torch-legacy")
    if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
        imports, more = pickle_imports(head)
        return FileKind("pickle", protocol=head[1], imports=imports, more_imports=more)
    if head.startswith(_LFS):
        return FileKind("lfs-pointer")
    if head.startswith(b"GGUF"):
        return FileKind("gguf")
    if head.startswith(b"\x93NUMPY"):
        return FileKind("npy")
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return FileKind("hdf5")
    if head.startswith(b"\x1f\x8b"):
        return FileKind("gzip")
    if len(head) >= 9 and head[8:9] == b"{":
        size = int.from_bytes(head[:8], "little")
        if 0 < size < 100_000_000:
            return FileKind("safetensors")
    if head.startswith(b"PK\x03\x04"):
        return FileKind("torn-zip")
    if _texty(head):
        return FileKind("html" if b"<html" in head[:4096].lower() else "text")
    return FileKind("unknown")


def _legacy_torch(head: bytes) -> bool:
    """A pickle whose first object is torch's magic number (any protocol)."""
    if head[:1] != b"\x80":
        return False
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(head[:64])):
            if op.name in ("PROTO", "FRAME"):
                continue
            return arg == _LEGACY_MAGIC
    except Exception:
        return False
    return False


def pickle_imports(data: bytes) -> tuple[tuple[str, ...], bool]:
    """The `module.name`s a pickle would import, in order, from its opcodes (parsed,
    never run); True when there were more than MAX_IMPORTS or the scan was cut short."""
    found: list[str] = []
    strings: list[str] = []  # the last strings pushed: STACK_GLOBAL's module and name
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            if op.name == "GLOBAL" and isinstance(arg, str):
                name = arg.replace(" ", ".", 1)
            elif op.name == "STACK_GLOBAL" and len(strings) == 2:
                name = ".".join(strings)
            else:
                if isinstance(arg, str) and "UNICODE" in op.name:
                    strings = [*strings[-1:], arg]
                continue
            if name not in found:
                found.append(name)
                if len(found) > MAX_IMPORTS:
                    return tuple(found[:MAX_IMPORTS]), True
    except Exception:  # cut at SCAN_BYTES, or damaged: what was parsed stands
        return tuple(found), len(data) >= SCAN_BYTES
    return tuple(found), False


def _texty(head: bytes) -> bool:
    sample = head[:4096]
    if not sample:
        return False
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(b >= 32 or b in b"\t\n\r\f" for b in sample)


def explain(kind: FileKind, *, unsafe_pickle_allowed: bool = True) -> str:
    """Why the file is not read as a torch.save file, and what to do; every message
    says that nothing of the file ran."""
    if kind.kind == "pickle":
        imports = ", ".join(kind.imports) + (", ..." if kind.more_imports else "")
        what = f"it imports {imports}" if imports else "it imports nothing"
        ways = (
            "If you trust the file, pass --unsafe-pickle to load it with pickle; "
            if unsafe_pickle_allowed
            else ""
        )
        return (
            f"a raw Python pickle (protocol {kind.protocol}, written by pickle.dump, "
            f"{what}), not a torch.save file. Loading a pickle runs whatever code it "
            "names, so deadweight did not unpickle it: no code from it ran. "
            f"{ways}{_SAFER}."
        )
    said = {
        "zip": "a zip archive without torch.save's data.pkl (not a torch.save file)",
        "lfs-pointer": "a Git LFS pointer (a small text file that stands for the real "
        "weights), not the weights: fetch them with `git lfs pull`",
        "gguf": "a GGUF file (llama.cpp's format), not a torch.save file; deadweight does "
        "not read GGUF",
        "npy": "a NumPy .npy array, not a torch.save file: save it with numpy.savez as .npz, "
        "or with safetensors",
        "hdf5": "an HDF5 file (Keras, h5py), not a torch.save file",
        "gzip": "a gzip-compressed file: decompress it first",
        "safetensors": "a safetensors file under a torch extension: rename it to .safetensors",
        "html": "an HTML page, not a checkpoint (a download that failed saves its error "
        "page under the file's name)",
        "text": "a text file, not a checkpoint",
        "torn-zip": "not a readable torch.save file (a zip archive whose directory is "
        "missing: truncated or damaged)",
        "unknown": "not a readable torch.save file (neither a zip archive nor a pickle, "
        "nor another format deadweight recognises)",
    }.get(kind.kind, "not a readable torch.save file")
    return f"{said}. Nothing in it was run."
