"""Trusted first stage of the code sandbox: confine this process, then exec the untrusted program.

Run as ``python -I -S _sandbox_launcher.py '<json settings>'`` in a fresh session (process
group). It uses only the standard library and touches nothing outside the scratch dir.
Layers, each applied when the platform allows it (the list applied is written to the report fd):

1. new network namespace (no interfaces but a downed loopback: every connect fails);
2. new mount namespace: fresh size-capped tmpfs over /tmp, /var/tmp and /dev/shm, the
   scratch dir bound at /tmp/work, and / remounted read-only;
3. resource limits: CPU seconds, address space, processes (fork bombs), file size, open
   files, no core dumps;
4. a uid of its own (root only): no write permission anywhere but the scratch dir, and a
   process count that no other sandbox shares;
5. in the program's interpreter, a guard disabling sockets and process creation.
"""
import ctypes
import json
import os
import resource
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

WORKDIR = "/tmp/work"
# The interpreter may live where a private uid cannot reach (e.g. under /root); its prefix
# is bound read-only here, inside the private /tmp.
PYTHON_MOUNT = "/tmp/.python"

# Runs inside the untrusted interpreter before the program. It cannot stop a determined
# attacker on its own (the kernel layers above do that); it turns the common cases into
# clean Python errors.
GUARD = r'''
import builtins, os, sys, socket, io
_exit = os._exit
def _blocked(*args, **kwargs):
    raise PermissionError("blocked by the posttrain sandbox")
class _NoSocket:
    def __init__(self, *args, **kwargs):
        _blocked()
socket.socket = _NoSocket
for _name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
    setattr(socket, _name, _blocked)
for _name in ("fork", "forkpty", "system", "popen", "kill", "killpg", "setsid", "setpgid",
              "execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe",
              "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp",
              "chroot", "putenv", "setuid", "setgid", "_exit"):
    if hasattr(os, _name):
        setattr(os, _name, _blocked)
import subprocess
subprocess.Popen = _blocked
_work = os.path.realpath(os.getcwd())
_real_open = builtins.open
def _open(file, mode="r", *args, **kwargs):
    if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
        target = os.path.realpath(os.fsdecode(file))
        if target != _work and not target.startswith(_work + os.sep):
            raise PermissionError(f"writes outside the sandbox are blocked: {target}")
    return _real_open(file, mode, *args, **kwargs)
builtins.open = io.open = _open
def _run(path, nonce):
    with _real_open(path) as f:
        code = compile(f.read(), "program.py", "exec")
    try:
        exec(code, {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as stop:
        # sys.exit(0) halfway through the tests must not count as a pass.
        sys.stderr.write(f"program called exit({stop.code})\n")
        sys.stderr.flush()
        _exit(3)
    sys.stdout.flush()
    sys.stdout.write("\n" + nonce + "\n")
    sys.stdout.flush()
_run(sys.argv[1], os.environ.pop("SANDBOX_NONCE", ""))
'''


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mount(libc, source, target, fstype, flags, data) -> bool:
    def enc(value):
        return value.encode() if isinstance(value, str) else value

    return libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) == 0


def isolate_namespaces(scratch: str, tmpfs_mb: int, python_prefix: str, applied: list[str]) -> str:
    """Enter new net/mount namespaces when allowed; return the directory to work in."""
    libc = _libc()
    if os.geteuid() == 0 and libc.unshare(CLONE_NEWNS | CLONE_NEWNET) == 0:
        applied.append("net_namespace")
        scratch_fd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY)
        if not _mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None):
            return scratch
        for shadowed in ("/tmp", "/var/tmp", "/dev/shm"):
            if os.path.isdir(shadowed):
                _mount(libc, "tmpfs", shadowed, "tmpfs", MS_NOSUID | MS_NODEV,
                       f"size={tmpfs_mb}m,mode=1777")
        os.mkdir(WORKDIR)
        if not _mount(libc, f"/proc/self/fd/{scratch_fd}", WORKDIR, None, MS_BIND, None):
            return scratch
        os.close(scratch_fd)
        os.mkdir(PYTHON_MOUNT)
        if not (_mount(libc, python_prefix, PYTHON_MOUNT, None, MS_BIND | MS_REC, None)
                and _mount(libc, None, PYTHON_MOUNT, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)):
            return scratch
        applied.append("private_tmp")
        if _mount(libc, None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY, None):
            applied.append("readonly_root")
        return WORKDIR
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        applied.append("net_namespace")
    return scratch


def apply_limits(limits: dict, applied: list[str]) -> None:
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    applied.append("rlimits")


def drop_privileges(uid: int, workdir: str, applied: list[str]) -> None:
    # Without the private /tmp the interpreter may be unreachable for another uid.
    if os.geteuid() != 0 or "private_tmp" not in applied:
        return
    os.chown(workdir, uid, uid)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    applied.append("own_uid")


def main() -> None:
    settings = json.loads(sys.argv[1])
    applied: list[str] = []
    prefix = settings["python_prefix"]
    workdir = isolate_namespaces(settings["scratch"], settings["limits"]["tmpfs_mb"], prefix, applied)
    os.chdir(workdir)
    apply_limits(settings["limits"], applied)
    drop_privileges(settings["uid_base"] + os.getpid(), workdir, applied)
    applied.append("python_guard")
    with os.fdopen(settings["report_fd"], "w") as report:
        report.write(json.dumps(applied))
    env = {
        "HOME": workdir,
        "TMPDIR": workdir,
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "SANDBOX_NONCE": settings["nonce"],
    }
    python = settings["python"]
    if "private_tmp" in applied:
        python = os.path.join(PYTHON_MOUNT, os.path.relpath(python, prefix))
        env["LD_LIBRARY_PATH"] = os.path.join(PYTHON_MOUNT, "lib")
    os.execve(python, [python, "-I", "-S", "-B", "-c", GUARD, "program.py"], env)


if __name__ == "__main__":
    main()
