"""Where the app is served, and whether it may be: a server listening on a non-loopback
address that the user did not ask for (``featcal app --host H`` sets
``FEATCAL_APP_HOST``) shows a refusal instead of loading anything. Streamlit with no
address set listens on every interface."""

from __future__ import annotations

import ipaddress
import os

from featcal.cli.app import HOST_ENV  # the address given with `featcal app --host`


def is_loopback(address: str | None) -> bool:
    if not address:
        return False  # no address: Streamlit listens on every interface
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def refusal(address: str | None, asked: str | None) -> str | None:
    """The message to show instead of the app, or None when serving on ``address`` is fine
    (loopback, or what the user asked for with ``featcal app --host``)."""
    if is_loopback(address) or (address and asked == address):
        return None
    where = f"address {address}" if address else "every network interface"
    return (
        f"This featcal app is served on {where}, which was not asked for: it has no login, so anyone who can "
        "reach it could load zoos and write files on this machine. Nothing was loaded. Start it with "
        "`featcal app` (this machine only, 127.0.0.1), or `featcal app --host ADDRESS` to expose it on purpose."
    )


def check(st) -> str | None:
    """:func:`refusal` for this server (None under ``AppTest``, which serves nothing: a real
    browser session always sends its request headers)."""
    if not st.context.headers:
        return None
    return refusal(st.get_option("server.address"), os.environ.get(HOST_ENV))
