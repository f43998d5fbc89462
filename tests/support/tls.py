"""Certificates for the TLS tests: a throw-away CA, a server cert for 127.0.0.1 and a client cert."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.process import ServerError


def make_certificates(directory: Path, client_cn: str = "") -> dict[str, Path]:
    """A self-signed CA, a server cert for 127.0.0.1/localhost and a client cert, made by openssl.

    ``client_cn``: the client cert's CommonName. Leave it empty for the v3 JSON gateway, which
    refuses a client cert with a CN once auth is enabled ("CommonName of client sending a request
    against gateway will be ignored"); give one for the v2 API, whose handler drops the
    connection on a client cert without a CN once v2 auth is enabled (etcd 3.4).
    Returns paths: ca, server_cert, server_key, client_cert, client_key.
    """
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "ca": directory / "ca.pem",
        "ca_key": directory / "ca.key",
        "server_cert": directory / "server.pem",
        "server_key": directory / "server.key",
        "client_cert": directory / "client.pem",
        "client_key": directory / "client.key",
    }
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args: str | Path) -> None:
        done = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise ServerError(f"openssl {' '.join(map(str, args))} failed:\n{done.stderr}")

    openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        files["ca_key"],
        "-out",
        files["ca"],
        "-days",
        "7",
        "-subj",
        "/CN=celery-etcdlock test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    for kind, cn, ext in (
        # etcd's own gateway dials the server with the server cert as a client cert: both usages.
        ("server", "127.0.0.1", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"),
        ("client", client_cn, "extendedKeyUsage=clientAuth\n"),
    ):
        csr = directory / f"{kind}.csr"
        extfile = directory / f"{kind}.ext"
        extfile.write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n" + ext)
        subject = f"/CN={cn}" if cn else "/O=celery-etcdlock test client"
        openssl("req", *ec, "-keyout", files[f"{kind}_key"], "-out", csr, "-subj", subject)
        openssl(
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            files["ca"],
            "-CAkey",
            files["ca_key"],
            "-CAcreateserial",
            "-out",
            files[f"{kind}_cert"],
            "-days",
            "7",
            "-extfile",
            extfile,
        )
    return files
