"""The authorizer's dial-back: it connects to the address a worker announced and expects the
challenge's dial token back (the worker's reachability listener, auth/admission.py).

Design choices:

- It connects and reads one line (it sends nothing), and only for a Join that passed every cheaper
  check, proof of possession included, within the caller's rate limits.
- The announced host is resolved here, once, and the connection goes to an address that passed
  ``dialback_allowed`` (auth/policy.py): globally routable, unless the run is local
  (``--local-network``). Dialling the address checked, rather than the name again, leaves no
  second lookup for a hostile DNS server to answer with 127.0.0.1.
- What went wrong (refused, timed out, not a public address, something else answering) is for the
  operator's log only: the node is told that its address is unreachable and what to open, the same
  words whatever happened, so that nobody can use the dial-back to map what listens where.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Optional

from agora.auth.policy import DIALBACK_PREFIX, dialback_allowed, dialback_answer

__all__ = ["dial_back"]


async def _resolve(host: str, port: int, timeout_s: float, local_network: bool) -> tuple[Optional[str], str]:
    """The address to dial (or None) and, without one, why."""
    loop = asyncio.get_running_loop()
    try:
        found = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout_s)
    except (OSError, asyncio.TimeoutError) as error:
        return None, f"{host} does not resolve ({error or type(error).__name__})"
    addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
    allowed = [address for address in addresses if dialback_allowed(address, local_network)]
    if not allowed:
        return None, (f"{host} resolves to {', '.join(addresses) or 'nothing'}: no public address (the dial-back "
                      "goes to loopback, private and link-local addresses only with --local-network)")
    return allowed[0], ""


async def dial_back(host: str, port: int, token: bytes, timeout_s: float, *,
                    local_network: bool = False) -> Optional[str]:
    """Connect to a worker's announced address and check its listener's answer; None when it is
    reachable, else what went wrong (one phrase, for the operator's log)."""
    address, problem = await _resolve(host, port, timeout_s, local_network)
    if address is None:
        return problem
    expected = dialback_answer(token)
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address, port), timeout_s)
        answer = await asyncio.wait_for(reader.readline(), timeout_s)
    except asyncio.TimeoutError:
        return f"no answer within {timeout_s:g} s" if writer is not None else f"no connection within {timeout_s:g} s"
    except (OSError, ValueError) as error:  # refused, unreachable; a line too long
        return getattr(error, "strerror", None) or str(error) or type(error).__name__
    finally:
        if writer is not None:
            writer.close()
    if answer == expected:
        return None
    if answer.startswith(DIALBACK_PREFIX):
        return "it answered with another challenge's token (a stale listener, or another node on that address)"
    return "something else answers on that port (not this node's admission listener)"
