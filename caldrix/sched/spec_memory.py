"""--speculation-memory: the draft tuner's state kept between runs, in one small JSON file.

Contract:
- `load` never fails a start: a missing file is a fresh start without a note; a file that cannot
  be read, is not this format, or was written for another pair of models (target and draft
  identity) is a fresh start with a note saying why.
- `save` replaces the file atomically (a temporary file in the same directory, flushed and
  fsynced, then os.replace), so a crash mid-write leaves the old file or the new one, never a
  torn one. A path that cannot be written (read-only directory) is a note, not an error.
- Pure file I/O and plain data: the scheduler task owns the tuner and calls these at start and
  when it stops; nothing here touches trio or torch.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import attrs

FORMAT = "caldrix-speculation-memory/1"
MAX_BYTES = 64 * 1024  # the file holds a few numbers; anything larger is not ours


@attrs.frozen
class TunerState:
    """What DraftTuner learns: decayed counts of kept and missed guesses, and the decayed mean
    pass time of each row count (seconds)."""

    kept: float
    missed: float
    seconds: tuple[tuple[int, float], ...]

    def to_json(self) -> dict:
        return {"kept": self.kept, "missed": self.missed, "seconds": {str(r): s for r, s in self.seconds}}

    @classmethod
    def from_json(cls, raw: object) -> "TunerState":
        if not isinstance(raw, dict) or set(raw) != {"kept", "missed", "seconds"}:
            raise ValueError("the tuner entry does not have the keys kept, missed and seconds")
        kept, missed, seconds = raw["kept"], raw["missed"], raw["seconds"]
        for name, v in (("kept", kept), ("missed", missed)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1e9:
                raise ValueError(f"{name} is not a count")
        if not isinstance(seconds, dict):
            raise ValueError("seconds is not an object")
        rows = []
        for k, v in seconds.items():
            if not k.isdigit() or not 1 <= int(k) <= 64:
                raise ValueError(f"row count {k!r} is out of range")
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < 60:
                raise ValueError(f"pass time for {k} rows is not a time in seconds")
            rows.append((int(k), float(v)))
        return cls(float(kept), float(missed), tuple(sorted(rows)))


@attrs.frozen
class SpeculationMemory:
    path: Path
    identity: str  # the target and draft models, e.g. "target=<digest> draft=<digest>"

    def load(self) -> tuple[TunerState | None, str | None]:
        """(state, note): state None is a fresh start; note says why when it is not just a
        missing file."""
        try:
            if self.path.is_fifo() or self.path.is_char_device() or self.path.is_socket():
                # open() of a FIFO waits for a writer: the start would hang for good
                return None, f"--speculation-memory {self.path}: not a regular file; starting fresh"
            with open(self.path, "rb") as f:
                data = f.read(MAX_BYTES + 1)
        except FileNotFoundError:
            return None, None
        except OSError as e:
            return None, f"--speculation-memory {self.path}: cannot be read ({e.strerror}); starting fresh"
        try:
            if len(data) > MAX_BYTES:
                raise ValueError(f"over {MAX_BYTES} bytes")
            raw = json.loads(data)
            if not isinstance(raw, dict) or raw.get("format") != FORMAT:
                raise ValueError("not a caldrix speculation memory file")
            if raw.get("identity") != self.identity:
                return None, (f"--speculation-memory {self.path}: written for another pair of models "
                              f"({raw.get('identity')!r}); ignored, starting fresh")
            return TunerState.from_json(raw.get("tuner")), None
        except RecursionError:  # JSON nested deeper than the parser goes
            return None, f"--speculation-memory {self.path}: unreadable (nested too deep); starting fresh"
        except (ValueError, UnicodeDecodeError) as e:
            return None, f"--speculation-memory {self.path}: unreadable ({e}); starting fresh"

    def save(self, state: TunerState) -> str | None:
        """Write state atomically; a note if the file could not be written, else None."""
        body = json.dumps({"format": FORMAT, "identity": self.identity, "tuner": state.to_json()},
                          sort_keys=True).encode()
        directory = self.path.parent
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=directory)
            with os.fdopen(fd, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            tmp = None
            try:  # make the rename itself durable
                dfd = os.open(directory, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            except OSError:
                pass
            return None
        except OSError as e:
            return f"--speculation-memory {self.path}: cannot be written ({e.strerror}); the tuner's state is not kept"
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
