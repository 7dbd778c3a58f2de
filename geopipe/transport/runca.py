"""The run's certificate authority: a CA made for one run and the one certificate it signs,
built with `cryptography` (X.509, EC P-256).

Its own module because issuing certificates is X.509 construction, a concern apart from
what :mod:`geopipe.transport.security` does with them (the run secret, the handshake, the
TLS contexts that trust only this CA); it is the only place that imports `cryptography`'s
X.509 builders, and only when a run encrypts.
"""

from __future__ import annotations

import datetime

__all__ = ["CERT_BACKDATE", "run_certificates"]

# Certificates start this long before the driver made them: a node whose clock is behind the
# driver's by less than this still accepts them (NTP-less nodes drift by minutes to hours).
CERT_BACKDATE = datetime.timedelta(days=1)


def run_certificates(
    run_id: str, start: datetime.datetime, end: datetime.datetime
) -> tuple[bytes, bytes, bytes]:
    """The run's CA (EC P-256) and the one certificate it signs, both valid from ``start``
    to ``end``, as PEM: ``(ca, certificate, private key)`` (see
    :func:`~geopipe.transport.security.make_credentials` for why one certificate)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"geopipe run {run_id} CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"geopipe run {run_id}")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return ca.public_bytes(pem), cert.public_bytes(pem), key_pem
