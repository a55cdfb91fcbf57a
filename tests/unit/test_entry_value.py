"""The writer's chain a typed entry carries: DER, length-delimited from the value's end."""

from __future__ import annotations

import base64

import pytest
from hivemind.utils import MSGPackSerializer

from agora.auth.authority import RunAuthority
from agora.auth.node_state import CREDENTIAL_FILE
from agora.dht.entry_value import (CHAIN_MARK, attached_credential_at, credential_attachment, older_credential_format,
                                   split_credential)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    base = tmp_path_factory.mktemp("entry-value")
    RunAuthority(base / "authority", run_id="run").mint(base / "node", role="worker", stage=0)
    return (base / "node" / CREDENTIAL_FILE).read_bytes()


def test_the_chain_comes_back_as_the_pem_it_was_and_the_value_as_it_was(chain):
    value = MSGPackSerializer.dumps({"endpoint": "127.0.0.1:1", "stage": 0})
    attached = value + credential_attachment(chain)
    assert split_credential(attached) == (value, chain)
    assert attached_credential_at(attached) == len(value)
    # DER: about 0.7 of the PEM, itself 0.75 of the base64 an older agora attached.
    assert len(credential_attachment(chain)) < 0.75 * len(chain) < 0.6 * len(base64.b64encode(chain))


def test_a_record_cannot_pass_for_a_chain_nor_a_garbled_tail_for_one(chain):
    # A record whose own bytes end like an attachment of nothing, or claim more than there is.
    for value in (b"", CHAIN_MARK, b"\x00" + CHAIN_MARK, b"x" + (100).to_bytes(2, "big") + b"\x01" + CHAIN_MARK,
                  b"\xc0" + credential_attachment(chain)[:-1]):
        assert split_credential(value) == (value, None) and attached_credential_at(value) == -1, value
    # What the record holds stays the record's, marks included: only the tail is read.
    tricky = MSGPackSerializer.dumps({"note": CHAIN_MARK.decode() + "[credential:x]"})
    assert split_credential(tricky + credential_attachment(chain)) == (tricky, chain)


def test_an_older_agoras_attachment_is_told_apart(chain):
    older = b"\xc0[credential:" + base64.b64encode(chain) + b"]"
    assert split_credential(older) == (older, None) and older_credential_format(older)
    assert not older_credential_format(b"\xc0" + credential_attachment(chain))
