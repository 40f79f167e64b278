"""TLS and bearer token through a real server: a client without the token or without TLS is refused;
with both it works. The server binds loopback by default and the token is checked on every call.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ppserve.server.client import PPServeClient
from tests.server_helpers import ServerProcess, running_server, set_args

TOKEN = "test-token-7f3a"


def make_self_signed(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost (cryptography, else the openssl CLI)."""
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        import subprocess

        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key_path), "-out", str(cert_path), "-days", "2", "-subj", "/CN=localhost",
             "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
            check=True, capture_output=True,
        )
        return cert_path, key_path
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    cert, key = make_self_signed(d)
    token_file = d / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    return cert, key, token_file


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir, tls_files) -> Iterator[ServerProcess]:
    cert, key, token_file = tls_files
    with running_server(tmp_path_factory.mktemp("security"), *set_args(
            f"model.model={tiny_llama_dir}", f"server.tls_cert={cert}", f"server.tls_key={key}",
            f"server.auth_token_file={token_file}", "server.max_concurrent_streams=16")) as proc:
        yield proc


def test_binds_loopback_by_default(server: ServerProcess) -> None:
    assert (server.address or "").startswith("127.0.0.1:")


def _listening_tcp() -> dict[str, str]:
    """Socket inode -> local address of every listening TCP socket on the machine (/proc/net/tcp{,6})."""
    out = {}
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(path).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A":  # TCP_LISTEN
                continue
            raw = bytes.fromhex(f[1].split(":")[0])
            # The kernel prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out[f[9]] = socket.inet_ntop(family, raw)
    return out


def _process_tree(root: int) -> set[int]:
    """root and its descendants, plus anything else in its session (ServerProcess starts one)."""
    parent, session = {}, set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # exited meanwhile
                continue
            parent[int(d.name)] = int(stat[1])
            if int(stat[3]) == root:
                session.add(int(d.name))
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier.extend(kids)
    return tree | session


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
def test_every_server_process_listens_on_loopback_only(server: ServerProcess, tls_files) -> None:
    """The gRPC server, the embedded Ray (GCS, raylet, agents, workers) and the stage actors' gloo store
    and pairs: no listening socket of the server's process tree is reachable from another machine."""
    with PPServeClient(server.address or "", root_certificates=str(tls_files[0]), token=TOKEN) as c:
        c.generate([5, 6, 7], max_tokens=2, ignore_eos=True, timeout=60)  # the pipeline has been used
        stage_pids = {w.pid for w in c.stats().workers}
    listening = _listening_tcp()
    found: dict[int, list[str]] = {}
    for pid in _process_tree(server.proc.pid):
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            inode = target[len("socket:["):-1] if target.startswith("socket:[") else None
            if inode in listening:
                found.setdefault(pid, []).append(listening[inode])
    assert stage_pids <= set(found), f"stage actors {stage_pids} not seen among {sorted(found)}"
    assert len(found) >= 4  # server, GCS, raylet, stage actors at least: the walk saw the whole tree
    exposed = {}
    for pid, addrs in found.items():
        for a in addrs:
            ip = ipaddress.ip_address(a)
            ip = getattr(ip, "ipv4_mapped", None) or ip  # ::ffff:127.0.0.1 is loopback too
            if not ip.is_loopback:
                exposed.setdefault(pid, []).append(a)
    names = {pid: Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:80] for pid in exposed}
    assert not exposed, f"listening beyond loopback: {exposed} {names}"


def test_tls_and_token_work(server: ServerProcess, tls_files) -> None:
    cert = tls_files[0]
    with PPServeClient(server.address or "", root_certificates=str(cert), token=TOKEN) as c:
        c.wait_ready(30)
        assert c.health() == "SERVING"
        out = c.generate([5, 6, 7], max_tokens=4, ignore_eos=True, timeout=60)
        assert len(out.token_ids) == 4 and out.finish_reason == "length"
        assert c.stats().kv_blocks_total > 0


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x"])
def test_missing_or_wrong_token_is_unauthenticated_on_every_call(server: ServerProcess, tls_files,
                                                                 token) -> None:
    with PPServeClient(server.address or "", root_certificates=str(tls_files[0]), token=token) as c:
        calls = [
            lambda: c.generate([5, 6], max_tokens=2, timeout=30),
            lambda: c.stats(timeout=30),
            lambda: c.cancel("anything", timeout=30),
            lambda: c.health(timeout=30),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED, e.value


def test_plaintext_client_is_refused(server: ServerProcess) -> None:
    with PPServeClient(server.address or "", token=TOKEN) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate([5, 6], max_tokens=2, timeout=10)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE


def test_untrusted_certificate_is_refused(server: ServerProcess) -> None:
    # TLS with the system roots: the self-signed server certificate does not verify.
    with PPServeClient(server.address or "", tls=True, token=TOKEN) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate([5, 6], max_tokens=2, timeout=10)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE


def test_cli_with_tls_and_token_file(server: ServerProcess, tls_files) -> None:
    import subprocess
    import sys

    cert, _, token_file = tls_files
    base = [sys.executable, "-m", "ppserve.cli", "stats", "--server", server.address or "", "--json"]
    ok = subprocess.run([*base, "--tls-ca", str(cert), "--token-file", str(token_file)], capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    denied = subprocess.run([*base, "--tls-ca", str(cert)], capture_output=True, text=True, timeout=60)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
