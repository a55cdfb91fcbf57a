"""`agora-node ledger verify FILE --ca ROOT.pem`: check a ledger export without trusting whoever made it.

An export (the monitor's `/api/ledger`, monitor/ledger.py) is the trainers' signed receipts and
the totals the monitor summed from them. This re-verifies every receipt against the run's root
certificate alone (auth/receipts.py: each carries its trainer's credential chain), refuses a
receipt repeated, and recomputes the totals; it prints each contributor's share, or one line
naming the first entry that fails (exit 1). A missing or unreadable file is exit 2.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from agora.pipeline.config import ConfigError

__all__ = ["add_ledger_command"]


def add_ledger_command(commands) -> None:
    ledger = commands.add_parser("ledger", help="the run's ledger of verified work: verify an export",
                                 description="Check a ledger export (the monitor's /api/ledger) against the run's "
                                             "root certificate, receipt by receipt, and recompute its totals.")
    actions = ledger.add_subparsers(dest="ledger_command", required=True)
    verify = actions.add_parser("verify", help="verify every receipt of an export and recompute the totals")
    verify.add_argument("file", help="the export, as /api/ledger serves it")
    verify.add_argument("--ca", required=True, metavar="ROOT_PEM",
                        help="the run's root certificate (root.pem in any admitted node's --state-dir)")
    verify.add_argument("--run-id", default=None, help="the run the receipts must be of (default: the export's)")
    verify.add_argument("--json", action="store_true", help="print the recomputed contributors as JSON")
    verify.set_defaults(handler=_cmd_ledger_verify)


def _cmd_ledger_verify(args: argparse.Namespace) -> int:
    from agora.auth.credentials import CredentialVerifier
    from agora.auth.receipts import ReceiptError
    from agora.monitor.ledger import verify_export

    try:
        document = json.loads(Path(args.file).read_text())
        root_pem = Path(args.ca).read_bytes()
    except (OSError, ValueError) as error:
        raise ConfigError(f"ledger verify: cannot read {args.file} or --ca {args.ca}: {error}") from None
    run_id = args.run_id or (document.get("run_id") if isinstance(document, dict) else None)
    if not isinstance(run_id, str) or not run_id:
        raise ConfigError("--run-id: the export names no run; give it")
    try:
        verifier = CredentialVerifier(root_pem, run_id, clock=time.time)
    except ValueError as error:
        raise ConfigError(f"--ca: not a PEM certificate ({error})") from None
    try:
        found = verify_export(document, verifier)
    except ReceiptError as error:
        print(f"ledger verify: REFUSED ({error.reason}): {error}")
        return 1
    if args.json:
        print(json.dumps([vars(entry) for entry in found], indent=1))
        return 0
    receipts = len(document["receipts"])
    print(f"ledger of run {run_id!r}: {receipts} receipts verified against root {verifier.root_fingerprint[:16]}")
    for entry in found:
        flagged = f", {entry.flagged_tokens} tokens flagged" if entry.flagged_receipts else ""
        print(f"  {entry.worker}  {entry.tokens} tokens  {entry.microbatches} microbatches  "
              f"{entry.receipts} receipts{flagged}")
    return 0
