"""`agora-node ledger verify FILE --ca ROOT.pem`: check a ledger export without trusting whoever made it;
`agora-node ledger export --state-dir D`: a worker's own receipts and round attestations as such an export.

An export (the monitor's `/api/ledger`, monitor/ledger.py) is the trainers' signed receipts and
the totals the monitor summed from them; a worker's own export also carries the attestations of
the averaging rounds it joined, signed by the rounds' other members, and its rounds derived from
them (monitor/attested_rounds.py). This re-verifies every receipt and every attestation against
the run's root certificate alone (each carries its signer's credential chain), refuses one
repeated, and recomputes the totals; it prints each contributor's share and the rounds at least
one other member attests (each stage and round once), or one line naming the first entry that
fails (exit 1). A missing or unreadable file is exit 2.

A worker keeps both in `receipts.sqlite` in its state dir (node/worker/receipts.py,
node/worker/attestations.py). `export` writes them in that form (read-only: the worker may be
running), checked the way `verify` checks it first, so a contributor can hand its proof of work to
anyone who holds the run's root certificate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from agora.pipeline.config import ConfigError

__all__ = ["add_ledger_command"]


def add_ledger_command(commands) -> None:
    ledger = commands.add_parser("ledger", help="the run's ledger of verified work: verify an export, export a "
                                               "worker's own receipts and round attestations",
                                 description="Check a ledger export (the monitor's /api/ledger, or a worker's own "
                                             "receipts and round attestations exported) against the run's root "
                                             "certificate, entry by entry, and recompute its totals.")
    actions = ledger.add_subparsers(dest="ledger_command", required=True)
    verify = actions.add_parser("verify", help="verify every receipt and attestation of an export and recompute "
                                               "the totals")
    verify.add_argument("file", help="the export, as /api/ledger serves it")
    verify.add_argument("--ca", required=True, metavar="ROOT_PEM",
                        help="the run's root certificate (root.pem in any admitted node's --state-dir)")
    verify.add_argument("--run-id", default=None, help="the run the receipts must be of (default: the export's)")
    verify.add_argument("--json", action="store_true", help="print the recomputed contributors and attested rounds "
                                                            "as JSON")
    verify.set_defaults(handler=_cmd_ledger_verify)
    export = actions.add_parser("export", help="a worker's kept receipts and round attestations as a ledger export, "
                                               "for `ledger verify`")
    export.add_argument("--state-dir", required=True, help="the worker's --state-dir (it holds receipts.sqlite)")
    export.add_argument("--out", default="-", help="the file to write (default: standard output)")
    export.set_defaults(handler=_cmd_ledger_export)


def _cmd_ledger_verify(args: argparse.Namespace) -> int:
    from agora.auth.credentials import CredentialVerifier
    from agora.auth.signed_statements import StatementError
    from agora.monitor.attested_rounds import verify_attestations
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
        rounds = verify_attestations(document, verifier)
    except StatementError as error:
        print(f"ledger verify: REFUSED ({error.reason}): {error}")
        return 1
    if args.json:
        print(json.dumps({"contributors": [vars(entry) for entry in found],
                          "attested_rounds": [vars(entry) for entry in rounds]}, indent=1))
        return 0
    attestations = len(document.get("attestations", []))
    print(f"ledger of run {run_id!r}: {len(document['receipts'])} receipts and {attestations} round attestations "
          f"verified against root {verifier.root_fingerprint[:16]}")
    for entry in found:
        flagged = f", {entry.flagged_tokens} tokens flagged" if entry.flagged_receipts else ""
        print(f"  {entry.worker}  {entry.tokens} tokens  {entry.microbatches} microbatches  "
              f"{entry.receipts} receipts{flagged}")
    for entry in rounds:
        print(f"  {entry.worker}  {entry.rounds} averaging rounds attested by other members (stage "
              f"{', '.join(map(str, entry.stages))}; {entry.attestations} attestations by "
              f"{len(entry.attesters)} of them)")
    return 0


def _cmd_ledger_export(args: argparse.Namespace) -> int:
    from agora.auth.credentials import CredentialVerifier
    from agora.auth.node_state import ROOT_FILE, RUN_FILE, RunInfo
    from agora.auth.signed_statements import StatementError
    from agora.monitor.attested_rounds import AttestationTable, verify_attestations
    from agora.monitor.ledger import ReceiptTable, verify_export
    from agora.node.worker.receipts import RECEIPTS_FILE
    from agora.pipeline.files import atomic_write

    state = Path(args.state_dir)
    path = state / RECEIPTS_FILE
    if not path.is_file():
        raise ConfigError(f"--state-dir: no {RECEIPTS_FILE} in {state}: no worker ran with this state dir and a "
                          "credential yet (a worker keeps its receipts and round attestations there)")
    try:
        verifier = CredentialVerifier((state / ROOT_FILE).read_bytes(),
                                      RunInfo.from_json((state / RUN_FILE).read_text()).run_id, clock=time.time)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"--state-dir: cannot read the run's root and id from {state}: {error}") from None
    receipts, attestations = (ReceiptTable(path, clock=time.time, read_only=True),
                              AttestationTable(path, clock=time.time, read_only=True))
    try:
        document = {**receipts.export(verifier), **attestations.export()}
    finally:
        receipts.close()
        attestations.close()
    try:
        found, rounds = verify_export(document, verifier), verify_attestations(document, verifier)
    except StatementError as error:  # the file was changed behind the worker's back
        print(f"ledger export: REFUSED ({error.reason}): {path}: {error}", file=sys.stderr)
        return 1
    text = json.dumps(document, indent=1) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        atomic_write(args.out, text.encode(), mode=0o644)
    tokens, attested = sum(entry.tokens for entry in found), sum(entry.rounds for entry in rounds)
    print(f"ledger export: {len(document['receipts'])} receipts ({tokens} tokens) and "
          f"{len(document['attestations'])} round attestations ({attested} rounds) of run {verifier.run_id!r}"
          f"{'' if args.out == '-' else ' written to ' + args.out}; check with: agora-node ledger verify "
          f"{'FILE' if args.out == '-' else args.out} --ca {state / ROOT_FILE}", file=sys.stderr)
    return 0
