"""Doctor checks of an s3:// store: reachability and addressing style, conditional writes
(a create-only put tried twice on a scratch key), and clock skew against the server."""

from __future__ import annotations

import email.utils
import ipaddress
import secrets
import time
from typing import Any
from urllib.parse import urlsplit

from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from botocore.session import get_session

from kvstash.doctor.findings import Finding, ok, unsafe, warn
from storage.options import StoreURL
from storage.s3_client import S3Options

# SigV4 requests more than 15 minutes off the server's clock are refused
# (RequestTimeTooSkewed); well before that, object ages and `touch` intervals drift.
SKEW_UNSAFE_S = 900.0
SKEW_WARN_S = 30.0
SCRATCH_DIR = ".kvstash-doctor"


def _client(o: S3Options, addressing: str) -> Any:
    config = Config(connect_timeout=o.connect_timeout, read_timeout=o.read_timeout,
                    retries={"total_max_attempts": 1},
                    signature_version=UNSIGNED if o.anonymous else None,
                    s3={"addressing_style": addressing})
    return get_session().create_client(
        "s3", region_name=o.region or "us-east-1", endpoint_url=o.endpoint,
        aws_access_key_id=o.access_key, aws_secret_access_key=o.secret_key,
        aws_session_token=o.session_token, config=config)


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _reach(o: S3Options) -> tuple[Any, list[Finding], float | None]:
    """A client that reaches the bucket (None if none does), findings, and the clock skew."""
    where = f"s3://{o.bucket} at {o.endpoint or 'AWS'}"
    styles = [o.addressing] + [s for s in ("path", "virtual") if s != o.addressing]
    failure = ""
    for style in styles:
        client = _client(o, style)
        try:
            sent = time.time()
            response = client.head_bucket(Bucket=o.bucket)
            received = time.time()
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            failure = f"{_status(exc)}" + (f" {code}" if code != str(_status(exc)) else "")
            if _status(exc) in (403, 404) and style == o.addressing:
                break  # the bucket answered: addressing is not the problem
            continue
        except (BotoCoreError, ValueError) as exc:
            failure = str(exc)
            continue
        date = response["ResponseMetadata"]["HTTPHeaders"].get("date")
        skew = None
        if date:
            server = email.utils.parsedate_to_datetime(date).timestamp()
            skew = server - (sent + received) / 2
        if style == o.addressing:
            return client, [ok("s3.reach", f"{where}: bucket reachable (addressing={style})")], skew
        return client, [unsafe("s3.addressing", f"{where}: unreachable with addressing="
                               f"{o.addressing} ({failure}), reachable with {style}",
                               f"add addressing={style} to the store URL")], skew
    return None, [unsafe("s3.reach", f"{where}: bucket not reachable ({failure})",
                         "check the endpoint, bucket name, region and credentials")], None


def check_skew(skew: float | None) -> Finding:
    if skew is None:
        return warn("s3.clock", "the server sent no Date header: clock skew unknown",
                    "keep this host on NTP (chrony/systemd-timesyncd)")
    line = f"clock differs from the S3 server's by {skew:+.1f}s"
    if abs(skew) >= SKEW_UNSAFE_S:
        return unsafe("s3.clock", f"{line}: signed requests are refused past 15 min",
                      "sync this host's clock (NTP: chrony or systemd-timesyncd)")
    if abs(skew) >= SKEW_WARN_S:
        return warn("s3.clock", line, "sync this host's clock with NTP")
    return ok("s3.clock", line)


def check_conditional(client: Any, o: S3Options) -> Finding:
    """Put one scratch object with If-None-Match: * twice: the second must get 412."""
    key = f"{o.prefix}{SCRATCH_DIR}/{secrets.token_hex(8)}"
    answers = []
    try:
        for _ in range(2):
            try:
                client.put_object(Bucket=o.bucket, Key=key, Body=b"kvstash doctor",
                                  IfNoneMatch="*")
                answers.append(200)
            except ClientError as exc:
                answers.append(_status(exc))
    except (BotoCoreError, ValueError) as exc:
        return warn("s3.conditional", f"scratch put failed: {exc}", "check write permission "
                    "on the bucket")
    finally:
        try:
            client.delete_object(Bucket=o.bucket, Key=key)
        except (BotoCoreError, ClientError):
            pass
    if answers == [200, 412]:
        return ok("s3.conditional", "If-None-Match: * enforced (a second create-only put got "
                  "412): saves are create-only in one request")
    if answers[0] in (401, 403):
        return unsafe("s3.conditional", f"scratch put refused ({answers[0]}): saves will fail",
                      "grant s3:PutObject and s3:DeleteObject on the prefix")
    return warn("s3.conditional", f"the server ignores If-None-Match (create-only puts "
                f"answered {answers[0]} then {answers[1]}): kvstash puts HEAD first instead, "
                "one more round trip per save, and two writers of one new chunk may both "
                "upload it (same bytes)", "use a server that enforces If-None-Match: * "
                "(AWS S3, recent MinIO, Ceph RGW, SeaweedFS); set conditional=head to skip "
                "the probe")


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_s3(url: str) -> list[Finding]:
    o = S3Options.from_url(StoreURL(url))
    client, out, skew = _reach(o)
    if client is None:
        return out
    out.append(check_skew(skew))
    out.append(check_conditional(client, o))
    host = urlsplit(o.endpoint or "").hostname or ""
    if o.endpoint and o.endpoint.startswith("http://") and not _loopback(host):
        out.append(warn("s3.tls", f"{o.endpoint}: plain HTTP: request signatures are safe, "
                        "chunk contents (prompts' KV) cross the network unencrypted",
                        "use an https:// endpoint unless the link is private"))
    return out
