"""How much host memory this process may still take: what `host_budget_gib='auto'` resolves to."""

from __future__ import annotations

from pathlib import Path

GIB = 2**30
RESERVE_FRACTION = 0.1  # left for the rest of the process (activations on the CPU, the pipeline's other parts)
RESERVE_MIN = 2 * GIB


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room(root: Path) -> int | None:
    """limit - usage of this process's memory cgroup (v2, else v1); None without a limit."""
    for limit_name, usage_name in (("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")):
        for directory in _cgroup_dirs(root):
            try:
                limit_text = (directory / limit_name).read_text().strip()
                usage = int((directory / usage_name).read_text().strip())
            except (OSError, ValueError):
                continue
            if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= 1 << 60:  # v1's "no limit"
                return None
            return max(0, int(limit_text) - usage)
    return None


def _cgroup_dirs(root: Path) -> list[Path]:
    """This process's cgroup directories under `root` (v2's unified one and v1's memory one)."""
    dirs = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return [root, root / "memory"]
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":
            dirs.append(root / relative)
        elif "memory" in controllers.split(","):
            dirs += [root / "memory" / relative, root / "memory"]
    return dirs + [root, root / "memory"]


def available_host_bytes(meminfo: Path = Path("/proc/meminfo"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """What the machine (MemAvailable) and this process's memory cgroup (limit - usage) both
    still allow, less a reserve of max(10 %, 2 GiB); 0 when neither can be read."""
    known = [room for room in (_meminfo_available(meminfo), _cgroup_room(cgroup_root)) if room is not None]
    if not known:
        return 0
    room = min(known)
    return max(0, room - max(RESERVE_MIN, int(room * RESERVE_FRACTION)))
