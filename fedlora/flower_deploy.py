"""A real Flower deployment (docs/how-to/flower.md, "Flower on one machine and on several"; docs/design.md §9),
for any task kind with a Flower app module (``fedlora.llm.flower`` for ``fedlora run``,
``fedlora.synthetic.flower`` for the testbed): a module exposing ``server_app`` and ``client_app``.

Flower 1.42 splits a deployment into long-running processes: one **SuperLink** (the server's endpoint:
one HTTPS port for the Fleet, Control and Runtime APIs; it starts one ``flwr-serverapp`` process per run,
which runs the app module's ``server_app``) and one **SuperNode** per client (it holds one partition,
given as ``--node-config 'partition-id=K num-partitions=N'``, and starts a ``flwr-clientapp`` process per
message, which runs ``fedlora.flower_client.client_app``: the ClientApp of every app, which imports torch and the
run's node only for the messages that need them; ``fedlora.flower_warm`` forks that process from a warm one instead). A run is submitted with ``flwr run APP LINK
--run-config FILE.toml``: APP is the folder ``write_app_dir`` writes, LINK a connection named in
``$FLWR_HOME/config.toml``, and FILE names the run's config.

This module holds what those command lines need, in one place:

* ``write_app_dir``: the Flower app folder naming an app module's ``server_app`` (and fedlora's ClientApp);
* ``make_certs``: a CA and a server certificate for the SuperLink (TLS; SANs for the hosts it is reached at);
* ``superlink_command`` / ``supernode_command``: the two command lines, with fedlora's settings
  (TLS, no runtime dependency installation — the code is the installed package —, bounded retries);
  ``warm_command`` (``fedlora.flower_warm``): a SuperNode whose messages are forked from a warm process;
* ``check_reachable``: a TLS handshake with the SuperLink within a bounded wait (one-line error otherwise);
* ``write_run_config``: the run's resolved config as the TOML ``--run-config`` file (it travels with the run,
  so the SuperLink's machine needs no copy of it);
* ``LocalDeployment``: all of it on this machine's loopback — SuperLink, SuperNodes, ``flwr run`` — each its
  own process, stopped at the end (``fedlora flower local``, ``fedlora synthetic flower --deployment`` and the
  deployment tests use it).

Nothing here imports torch or flwr (``fedlora flower certs`` runs without them).
"""
from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedlora.errors import ConfigError
from fedlora.flower_warm import warm_command

__all__ = ["write_app_dir", "make_certs", "superlink_command", "supernode_command", "warm_command", "check_reachable",
           "write_run_config", "flower_env", "LocalDeployment", "FlowerRunFailed", "CERT_WRITES", "APP_WRITES", "APP_MINE",
           "WORK_WRITES", "claim_certs_dir", "claim_app_dir"]

#: what ``fedlora flower certs`` writes into its --out (``make_certs``): key material, never replaced unasked
CERT_WRITES = ("ca.pem", "server.pem", "server.key")
#: what ``fedlora flower app`` writes into its --out: the app's pyproject.toml and (with CONFIG) run.toml
APP_WRITES = ("pyproject.toml", "run.toml")
#: what a ``LocalDeployment`` writes into its work folder (``fedlora flower local --work``): the app, the
#: certificates and node keys, flwr's home and state, the processes' logs, the command lines, run configs
WORK_WRITES = ("app", "certs", "flwr-home", "state.db", "state.db-*", "commands.json", "superlink.log",
               "supernode*.log", "supernode*.key", "supernode*.key.pub", "supernode*.tasks.jsonl", "tmp*.toml")


def _written_by_app(path: Path) -> bool:
    """A pyproject.toml that ``write_app_dir`` wrote (``fedlora flower app``): its first line."""
    with open(path, "rb") as f:
        return f.readline().decode(errors="replace") in APP_HEADERS


def _written_as_run_config(path: Path) -> bool:
    """A run.toml that ``write_run_config`` wrote: it starts with the config's JSON text."""
    with open(path, "rb") as f:
        return f.read(len(_RUN_CONFIG_KEY)).decode(errors="replace") == _RUN_CONFIG_KEY


_RUN_CONFIG_KEY = "fedlora-config-json = "
#: ``claim_output_dir(…, mine=APP_MINE)``: the app folder's files are ours only if we wrote them (a
#: project's own pyproject.toml is never cleared, not even with --overwrite)
APP_MINE = {"pyproject.toml": _written_by_app, "run.toml": _written_as_run_config}


def claim_certs_dir(out: str | os.PathLike, overwrite: bool = False, flag: str = "--out"):
    """``fedlora flower certs``' output folder (``claim_output_dir``): new or empty, or — with ``overwrite``
    — a folder holding nothing but certificates this command writes. Key material already there is named
    in the refusal: a new CA would leave every SuperNode holding the old ``ca.pem`` unable to verify the SuperLink."""
    from fedlora.io import claim_output_dir

    have = [n for n in CERT_WRITES if (Path(out) / n).exists()]
    if have and not overwrite:
        raise ConfigError(f"{flag}: {str(out)!r} already holds key material ({', '.join(have)}): new certificates "
                          f"would leave every SuperNode and flwr holding the old ca.pem unable to verify the "
                          f"SuperLink; give --overwrite to replace them, or choose another folder")
    # nothing cleared here: make_certs(…, overwrite=True) replaces the files once the new ones are made
    return claim_output_dir(out, flag, writes=CERT_WRITES, overwrite=overwrite, clear=False)


def claim_app_dir(out: str | os.PathLike, overwrite: bool = False, flag: str = "--out"):
    """``fedlora flower app``'s output folder (``claim_output_dir``): new or empty, or — with ``overwrite`` —
    a folder holding nothing but an app this command wrote (``APP_MINE`` checks the files' content). A
    ``pyproject.toml`` it did not write (``--out .`` in a project's root) is refused in one line, even with
    ``overwrite``: it is the project's, never replaced."""
    from fedlora.io import claim_output_dir

    pyproject = Path(out) / "pyproject.toml"
    if pyproject.is_file() and not APP_MINE["pyproject.toml"](pyproject):
        raise ConfigError(f"{flag}: {str(out)!r} holds a pyproject.toml that `fedlora flower app` did not write "
                          f"(a project's own?): it is never replaced, not even with --overwrite; give the app a "
                          f"folder of its own, e.g. --out {str(Path(out) / 'flower-app')!r}")
    return claim_output_dir(out, flag, writes=APP_WRITES, overwrite=overwrite, mine=APP_MINE)


def _refuse_existing(paths: Sequence[Path], overwrite: bool) -> None:
    """Key files are never replaced unasked: ``ConfigError`` naming those of ``paths`` that exist."""
    have = [str(p) for p in paths if p.exists() or p.is_symlink()]
    if have and not overwrite:
        raise ConfigError(f"certs: {', '.join(have)} already exist{'s' if len(have) == 1 else ''}: key material is "
                          f"never replaced unless asked (overwrite=True; the command line's --overwrite)")

#: flwr 1.42's SuperExec (one beside the SuperLink, one beside each SuperNode) asks its parent for a new app
#: task every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` seconds (1 s by default): each ask is an HTTP request,
#: ≈ 6 ms of CPU on loopback (an idle 3-node deployment: 0.28 of a core at 0.1 s, 0.05 at 1 s, measured).
TASK_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
#: a ``LocalDeployment``'s SuperNodes ask every half second: ≤ 0.5 s (0.25 s on average) on a message wave,
#: whose SuperNode poll is 3 s and whose ClientApp is a new Python process, for ≈ 0.01 of a core per node
#: (at a tenth of a second, the CPU those requests take is taken from the ClientApps on a small machine)
NODE_TASK_POLL_S = 0.5

#: where flwr's programs live: the SuperLink and SuperNodes start ``flower-superexec``, ``flwr-serverapp`` and
#: ``flwr-clientapp`` by name, so this folder must be on their PATH too (``flower_env``)
BIN = Path(sys.executable).parent


class FlowerRunFailed(RuntimeError):
    """A submitted run ended without a complete run folder (the message says why, in one line)."""


# ----------------------------------------------------------------------------------------------------
# TLS
def make_certs(folder: str | os.PathLike, hosts: Sequence[str] = ("localhost", "127.0.0.1", "::1"),
               days: int = 365, *, overwrite: bool = False) -> dict[str, Path]:
    """A self-signed CA (``ca.pem``) and a SuperLink certificate signed by it (``server.pem``, ``server.key``,
    EC P-256) valid for ``hosts`` (DNS names or IP addresses: every name the SuperLink is reached at).
    Existing files of those names are refused (``ConfigError``) unless ``overwrite``.
    SuperNodes and ``flwr`` verify the SuperLink with ``ca.pem``. For trials and closed networks; a real
    deployment may use certificates from its own CA instead — the command lines take any PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise ConfigError("certs: give at least one host name or address the SuperLink is reached at")
    sans = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    out = Path(folder)
    paths = {"ca": out / "ca.pem", "cert": out / "server.pem", "key": out / "server.key"}
    _refuse_existing(list(paths.values()), overwrite)
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedlora flower CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(hosts[0]))]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    if overwrite:  # the key is created afresh below (mode 0600 from its first byte)
        paths["key"].unlink(missing_ok=True)
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].touch(mode=0o600)
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths


def make_node_key(path: str | os.PathLike, *, overwrite: bool = False) -> tuple[Path, Path]:
    """A SuperNode's authentication key pair (EC P-384, OpenSSH format — the kind flwr 1.42 accepts):
    ``path`` (private, for ``--auth-supernode-private-key``) and ``path.pub`` (for ``flwr supernode register``).
    Existing files are refused (``ConfigError``) unless ``overwrite``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    priv, pub = Path(path), Path(f"{path}.pub")
    _refuse_existing([priv, pub], overwrite)
    if overwrite:
        priv.unlink(missing_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    priv.touch(mode=0o600)
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    return priv, pub


# ----------------------------------------------------------------------------------------------------
# command lines
def _address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--superlink: must be HOST:PORT (e.g. 10.0.0.5:9092), got {address!r}")
    return host.strip("[]"), int(port)


def superlink_command(*, host: str = "0.0.0.0", port: int = 9092, certs: Mapping[str, os.PathLike] | None = None,
                      database: str | os.PathLike | None = None, auth: bool = False) -> list[str]:
    """``flower-superlink`` serving its one port on ``host:port``: TLS with ``certs`` (``make_certs``'s
    ca/cert/key), ``--insecure`` without; ``auth``: only registered SuperNodes may connect (needs TLS).
    Runtime dependency installation is off: the apps are the installed fedlora, nothing to install."""
    cmd = [str(BIN / "flower-superlink"), "--host", host, "--port", str(port),
           "--disable-runtime-dependency-installation"]
    if certs is not None:
        cmd += ["--ssl-ca-certfile", str(certs["ca"]), "--ssl-certfile", str(certs["cert"]),
                "--ssl-keyfile", str(certs["key"])]
    elif auth:
        raise ConfigError("--auth: SuperNode authentication needs TLS (give --certs)")
    else:
        cmd.append("--insecure")
    if database is not None:
        cmd += ["--database", str(database)]
    if auth:
        cmd.append("--enable-supernode-auth")
    return cmd


def supernode_command(superlink: str, partition: int, partitions: int, *, ca: str | os.PathLike | None = None,
                      port: int = 9094, auth_key: str | os.PathLike | None = None, max_wait_s: float = 60.0) -> list[str]:
    """``flower-supernode`` holding client ``partition`` of ``partitions``: it connects to ``superlink``
    (HOST:PORT), verifying it with ``ca`` (``--insecure`` without), gives up after ``max_wait_s`` seconds
    without the SuperLink, and serves its ClientApps on local ``port`` (one free port per SuperNode on a host)."""
    _address(superlink)
    if not 0 <= partition < partitions:
        raise ConfigError(f"--partition: must be in 0..{partitions - 1} (--partitions {partitions}), got {partition}")
    cmd = [str(BIN / "flower-supernode"), "--superlink", superlink,
           "--node-config", f"partition-id={int(partition)} num-partitions={int(partitions)}",
           "--port", str(port), "--max-wait-time", f"{max_wait_s:g}"]
    cmd += ["--root-certificates", str(ca)] if ca is not None else ["--insecure"]
    if auth_key is not None:
        cmd += ["--auth-supernode-private-key", str(auth_key)]
    return cmd


def flower_env(home: str | os.PathLike | None = None) -> dict[str, str]:
    """The environment of flwr's processes: its programs on PATH, ``FLWR_HOME`` (its config.toml, apps and
    state; default ``~/.flwr``) and telemetry off."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["FLWR_TELEMETRY_ENABLED"] = "0"
    if home is not None:
        env["FLWR_HOME"] = str(home)
    return env


def check_reachable(address: str, ca: str | os.PathLike | None, timeout: float) -> float:
    """Wait until ``address`` (HOST:PORT) accepts a connection — a TLS handshake verified with ``ca`` when
    given — for at most ``timeout`` seconds; the seconds it took. Else one line: what was tried, for how long, why."""
    host, port = _address(address)
    ctx = ssl.create_default_context(cafile=str(ca)) if ca is not None else None
    t0 = time.monotonic()
    why = "no answer"
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, max(0.1, timeout))) as s:
                if ctx is None:
                    return time.monotonic() - t0
                with ctx.wrap_socket(s, server_hostname=host):
                    return time.monotonic() - t0
        except ssl.SSLCertVerificationError as e:  # waiting will not fix a certificate
            raise ConfigError(f"SuperLink {address}: its certificate does not verify with {ca}: "
                              f"{e.verify_message or e}") from None
        except OSError as e:
            why = e.strerror or str(e) or type(e).__name__
        if time.monotonic() - t0 >= timeout:
            raise ConfigError(f"SuperLink {address}: not reachable after {timeout:g} s ({why})")
        time.sleep(0.2)


def write_run_config(path: str | os.PathLike, config: Mapping[str, Any], *, out: str | None = None,
                     overwrite: bool = False) -> Path:
    """The TOML file ``flwr run … --run-config FILE`` sends with the run: the resolved config as JSON text
    (``fedlora-config-json``), the run folder on the SuperLink's machine (``out``; the config's output_dir
    when None) and ``overwrite``. A JSON string is a valid TOML basic string, escapes included."""
    text = json.dumps(dict(config), sort_keys=True)
    lines = [f"{_RUN_CONFIG_KEY}{json.dumps(text)}", f"overwrite = {'true' if overwrite else 'false'}"]
    if out is not None:
        lines.append(f"out = {json.dumps(str(out))}")
    p = Path(path)
    p.write_text("\n".join(lines) + "\n")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pids: set[int]) -> set[int]:
    """Every process below ``pids``, and the processes that watch one of them (``--parent-pid P``: flwr's
    SuperExec is started detached, in a session of its own, and ends when P does — a while after)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
            if b"--parent-pid" in argv[:-1]:
                watched = argv[argv.index(b"--parent-pid") + 1]
                if watched.isdigit():
                    kids.setdefault(int(watched), []).append(int(d.name))
    out, todo = set(), list(pids)
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


# ----------------------------------------------------------------------------------------------------
class LocalDeployment:
    """A SuperLink and ``nodes`` SuperNodes (partitions 0..nodes-1) on 127.0.0.1, each its own process, with
    TLS (``tls``; certificates made in ``work``) and optionally SuperNode authentication (``auth``: each
    node's key registered with ``flwr supernode register`` before it starts). ``work`` holds the
    certificates, flwr's home and state, and every process's log (``<name>.log``).

    Use as a context manager: ``start`` on entry; on exit ``stop`` ends every process it started,
    SuperExec and app processes included. ``submit`` starts one run; ``wait`` waits for its run folder.

    Flower's own pace: a SuperNode polls every 3 s and runs every message in a new process, so a round on a
    deployment takes seconds however small the model (bench/flower_overhead.py measures it). With ``warm``
    (the default) each SuperNode's SuperExec is ``fedlora.flower_warm``: every message's process is forked
    from one that imported ``preload``, ``app`` and fedlora's ClientApp once (``work/supernode<K>.tasks.jsonl``
    lists them); ``warm=False``: flwr's own SuperExec, a new ``flwr-clientapp`` interpreter per message.
    """

    def __init__(self, work: str | os.PathLike, nodes: int, *, app: str, tls: bool = True, auth: bool = False,
                 start_timeout: float = 60.0, node_wait_s: float = 60.0, warm: bool = True,
                 preload: Sequence[str] = ()) -> None:
        """``app``: the Flower app module the deployment runs (``write_app_dir``), e.g. ``fedlora.llm.flower``;
        ``preload``: modules the warm SuperExecs import besides ``app`` (e.g. ``transformers``)."""
        if nodes < 1:
            raise ConfigError(f"nodes: must be ≥ 1, got {nodes}")
        self.warm, self.preload = bool(warm), (*[str(m) for m in preload], str(app))
        self.work = Path(work).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.nodes, self.tls, self.auth = int(nodes), bool(tls), bool(auth)
        self.start_timeout, self.node_wait_s = float(start_timeout), float(node_wait_s)
        self.home = self.work / "flwr-home"
        self.env = flower_env(self.home)  # the SuperLink's and flwr's (its SuperExec: flwr's 1 s poll, or the user's)
        #: the SuperNodes' environment: their SuperExecs ask for a message's task every NODE_TASK_POLL_S
        #: (``TASK_POLL_ENV``; a value the user set is kept)
        self.node_env = {TASK_POLL_ENV: f"{NODE_TASK_POLL_S:g}", **self.env}
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.certs: dict[str, Path] | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, list[str]] = {}  # what was started (also in work/commands.json)
        self._seen: set[int] = set()
        #: how many times ``status`` asked the SuperLink (``flwr ls``): ``wait`` asks only while no ServerApp runs
        self.status_checks = 0
        self.app, self.app_dir = str(app), self.work / "app"

    # -- processes ---------------------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str], env: Mapping[str, str] | None = None) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "wb")
        try:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(self.env if env is None else env),
                                 cwd=self.work, start_new_session=True)
        finally:
            log.close()
        self.procs[name] = p
        self.commands[name] = cmd
        (self.work / "commands.json").write_text(json.dumps(self.commands, indent=1))
        return p

    def log(self, name: str, lines: int = 20) -> str:
        """The last ``lines`` lines of process ``name``'s log (superlink, supernode<K>)."""
        p = self.work / f"{name}.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.exists() else ""

    def start(self) -> "LocalDeployment":
        self.home.mkdir(exist_ok=True)
        write_app_dir(self.app_dir, self.app)
        if self.tls:
            self.certs = make_certs(self.work / "certs", ("127.0.0.1", "localhost"))
        link = f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "{self.address}"\n'
        link += f'root-certificates = "{self.certs["ca"]}"\n' if self.certs else "insecure = true\n"
        (self.home / "config.toml").write_text(link)
        self._spawn("superlink", superlink_command(host="127.0.0.1", port=self.port, certs=self.certs,
                                                   database=self.work / "state.db", auth=self.auth))
        try:
            check_reachable(self.address, self.certs["ca"] if self.certs else None, self.start_timeout)
        except ConfigError as e:
            raise ConfigError(f"{e}; its log: {self.work / 'superlink.log'}") from None
        keys: dict[int, Path | None] = dict.fromkeys(range(self.nodes))
        if self.auth:  # every node's key registered before its node starts: the registrations side by side
            keys = {k: make_node_key(self.work / f"supernode{k}.key") for k in range(self.nodes)}
            done = self.flwr_all([["supernode", "register", str(pub), "local", "--name", f"partition-{k}"]
                                  for k, (_, pub) in keys.items()])
            for k, r in enumerate(done):
                if r.returncode != 0:
                    raise ConfigError(f"flwr supernode register (partition {k}) failed: {_last_line(r.stderr or r.stdout)}")
            keys = {k: priv for k, (priv, _) in keys.items()}
        for k in range(self.nodes):
            cmd = supernode_command(self.address, k, self.nodes, ca=self.certs["ca"] if self.certs else None,
                                    port=_free_port(), auth_key=keys[k], max_wait_s=self.node_wait_s)
            if self.warm:
                cmd = warm_command(cmd, preload=self.preload, ledger=self.work / f"supernode{k}.tasks.jsonl")
            self._spawn(f"supernode{k}", cmd, env=self.node_env)
        return self

    def flwr(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """Run the ``flwr`` command line against this deployment (connection name ``local``)."""
        return subprocess.run([str(BIN / "flwr"), *args], env=self.env, cwd=self.work, capture_output=True,
                              text=True, timeout=timeout)

    def flwr_all(self, calls: Sequence[Sequence[str]], timeout: float = 120.0) -> list[subprocess.CompletedProcess]:
        """``flwr`` once per argument list of ``calls``, the processes side by side (each is seconds of Python
        start-up); their results in order. One still running after ``timeout`` s is killed (status -9)."""
        procs = [subprocess.Popen([str(BIN / "flwr"), *args], env=self.env, cwd=self.work, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for args in calls]
        deadline, out = time.monotonic() + timeout, []
        for args, p in zip(calls, procs):
            try:
                so, se = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                so, se = p.communicate()
            out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
        return out

    def stop(self) -> list[int]:
        """Stop every process this deployment started (SIGTERM, SIGKILL after 10 s); the pids that had to be
        killed one by one afterwards (processes that had left the process groups)."""
        mine = {p.pid for p in self.procs.values()}
        self._seen |= mine | _descendants(mine)
        for p in reversed(list(self.procs.values())):  # SuperNodes first, then the SuperLink
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
        left = []
        self._seen |= _descendants(self._seen)
        for pid in sorted(self._seen):
            if _alive(pid):
                left.append(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while left and time.monotonic() < deadline and any(_alive(pid) for pid in left):
            time.sleep(0.05)
        self.procs.clear()
        return left

    def __enter__(self) -> "LocalDeployment":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- runs --------------------------------------------------------------------------------------------
    def submit(self, config: Mapping[str, Any], *, out: str | os.PathLike, overwrite: bool = False) -> int:
        """Start a run of ``config`` (what the app's ServerApp reads: a ``RunConfig.to_dict()``, a testbed spec) writing its run folder ``out``; its run id."""
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise FlowerRunFailed(f"{name} exited (status {p.returncode}): {_last_line(self.log(name))}")
        self._seen |= _descendants({p.pid for p in self.procs.values()})
        rc_file = write_run_config(Path(tempfile.mkstemp(suffix=".toml", dir=self.work)[1]), config,
                                   out=str(Path(out).resolve()), overwrite=overwrite)
        r = self.flwr("run", str(self.app_dir), "local", "--format", "json", "--run-config", str(rc_file))
        if r.returncode != 0:
            raise FlowerRunFailed(f"flwr run: {_last_line(r.stdout + r.stderr)}")
        try:
            return int(json.loads(r.stdout)["run-id"])
        except (ValueError, KeyError) as e:
            raise FlowerRunFailed(f"flwr run: no run id in its output ({_last_line(r.stdout)})") from e

    def serverapps(self) -> list[int]:
        """The live ServerApp processes of this deployment's SuperLink (``flwr-serverapp``, one per running run,
        started by the SuperLink's SuperExec); read from /proc, no process started."""
        link = self.procs.get("superlink")
        out = []
        for pid in sorted(_descendants({link.pid}) if link is not None else ()):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(a.endswith(b"flwr-serverapp") for a in argv[:2]) and _alive(pid):
                out.append(pid)
        return out

    def status(self, run_id: int) -> str:
        """Flower's status of run ``run_id``, e.g. ``running`` or ``finished:completed`` (``""`` if unknown)."""
        self.status_checks += 1
        r = self.flwr("ls", "local", "--run-id", str(run_id), "--format", "json")
        try:
            runs = json.loads(r.stdout).get("runs", [])
        except ValueError:
            return ""
        return str(runs[0].get("status", "")) if runs else ""

    def wait(self, run_id: int, out: str | os.PathLike, timeout: float) -> dict[str, Any]:
        """Wait (at most ``timeout`` s) until run ``run_id``'s folder ``out`` is finished; its run.json.
        ``FlowerRunFailed`` (one line) when the run failed, or ended, or ran out of time without a complete folder.
        The SuperLink is asked how the run stands (``status``) only while no ServerApp of this deployment runs."""
        run_json = Path(out) / "run.json"
        deadline = time.monotonic() + timeout
        next_look, next_ask = time.monotonic() + 1, time.monotonic() + 10
        while True:
            # looked at before run.json, which a ServerApp writes before it ends: a ServerApp that has ended has
            # either written its folder, or died, and only then is the SuperLink asked how the run ended
            now = time.monotonic()
            if now >= next_look:
                next_look = now + 1
                if self.serverapps():  # it runs: nothing to ask the SuperLink (`flwr ls` is a process, ≈ 1 CPU-s);
                    next_ask = now + 1  # once it has ended, ask within a second or two
            if run_json.exists():
                try:
                    state = json.loads(run_json.read_text())
                except ValueError:  # written atomically: only a foreign file reads badly
                    state = {}
                if state.get("status") == "complete":
                    return state
                if state.get("status") in ("failed", "interrupted"):
                    raise FlowerRunFailed(f"run {run_id} {state['status']} after round {state.get('rounds_done')}: "
                                          f"{state.get('error') or state.get('signal')}")
            if now >= next_ask:  # the ServerApp has ended (or not started yet) without a complete folder
                next_ask = now + 10
                st = self.status(run_id)
                if st.startswith("finished") and not (run_json.exists() and "complete" in run_json.read_text()):
                    time.sleep(1.0)  # run.json is written before the ServerApp returns; give the disk a moment
                    if not (run_json.exists() and json.loads(run_json.read_text()).get("status") == "complete"):
                        raise FlowerRunFailed(f"run {run_id} {st}: {self.run_error(run_id)}")
            if time.monotonic() >= deadline:
                raise FlowerRunFailed(f"run {run_id}: not finished after {timeout:g} s "
                                      f"(flower status {self.status(run_id) or 'unknown'}; logs in {self.work})")
            time.sleep(0.5)

    def run_error(self, run_id: int) -> str:
        """The last error line of run ``run_id``'s ServerApp log (``flwr log``)."""
        r = self.flwr("log", str(run_id), "local", "--show")
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
        errs = [ln for ln in lines if "Error" in ln or "error" in ln]
        return (errs or lines or ["no log"])[-1].strip()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


_PYPROJECT = """\
# A Flower app that runs fedlora's Flower runtime (written by fedlora.flower_deploy.write_app_dir).
# The code is the installed fedlora package: nothing to build, no dependencies to install here
# (start the SuperLink with --disable-runtime-dependency-installation).
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedlora-flower-app"
version = "1.0.0"
description = "fedlora on Flower: the run's config is the JSON file named by fedlora-config"
license = "Apache-2.0"
dependencies = ["flwr>=1.42.0"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedlora"

[tool.flwr.app.components]
serverapp = "{app}:server_app"
clientapp = "fedlora.flower_client:client_app"

[tool.flwr.app.config]
fedlora-config = ""
fedlora-config-json = ""
out = ""
overwrite = false
"""


#: first lines of the pyproject.toml files ``write_app_dir`` writes (and wrote when it lived in fedlora.llm.flower)
APP_HEADERS = (_PYPROJECT.splitlines(keepends=True)[0],
               "# A Flower app that runs fedlora's Flower runtime (written by fedlora.llm.flower.write_app_dir).\n")


def write_app_dir(path: str | os.PathLike, app: str) -> Path:
    """The Flower app folder ``flwr run PATH CONNECTION -c 'fedlora-config="/abs/config.json"'`` submits,
    naming the app module ``app``'s ``server_app`` (``fedlora.llm.flower`` for ``fedlora run``) and, as every
    app's ClientApp, ``fedlora.flower_client.client_app`` (the same object as ``app``'s ``client_app``, imported
    without ``app``, so that a message needing no model imports no torch). A ``pyproject.toml`` already there that this function did not write (a project's own) is
    never replaced: ``ConfigError`` (the command line claims the folder first, ``claim_app_dir``)."""
    p = Path(path)
    toml = p / "pyproject.toml"
    if toml.is_file() and not _written_by_app(toml):
        raise ConfigError(f"{str(p)!r} holds a pyproject.toml that is not a fedlora Flower app's (a project's "
                          f"own?): it is never replaced; give the app a folder of its own")
    p.mkdir(parents=True, exist_ok=True)
    (p / "pyproject.toml").write_text(_PYPROJECT.replace("{app}", str(app)))
    return p
