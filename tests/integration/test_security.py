"""TLS and bearer token through a real server: a client without the token or without TLS is refused;
with both it works. The server binds loopback by default and the token is checked on every call.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ppserve.server.client import PPServeClient
from tests.integration.test_server import STARTUP_TIMEOUT_S, ServerProcess

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
    proc = ServerProcess(
        tmp_path_factory.mktemp("security") / "server.log",
        "--set", f"model.model={tiny_llama_dir}",
        "--set", f"server.tls_cert={cert}",
        "--set", f"server.tls_key={key}",
        "--set", f"server.auth_token_file={token_file}",
        "--set", "server.max_concurrent_streams=16",
    )
    try:
        proc.wait_ready(STARTUP_TIMEOUT_S)
        yield proc
    finally:
        proc.stop()


def test_binds_loopback_by_default(server: ServerProcess) -> None:
    assert (server.address or "").startswith("127.0.0.1:")


def test_tls_and_token_work(server: ServerProcess, tls_files) -> None:
    cert = tls_files[0]
    with PPServeClient(server.address or "", root_certificates=str(cert), token=TOKEN) as c:
        c.wait_ready(30)
        assert c.health() == "SERVING"
        out = c.generate([5, 6, 7], max_tokens=4, ignore_eos=True, timeout=60)
        assert len(out.token_ids) == 4 and out.finish_reason == "length"
        assert c.stats()["kv_blocks_total"] > 0


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x"])
def test_missing_or_wrong_token_is_unauthenticated_on_every_call(server: ServerProcess, tls_files, token) -> None:
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
