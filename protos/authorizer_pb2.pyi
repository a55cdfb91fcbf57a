from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunDescription(_message.Message):
    __slots__ = ("run_id", "config_json", "fingerprint", "root_pem")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ROOT_PEM_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    config_json: str
    fingerprint: str
    root_pem: bytes
    def __init__(self, run_id: _Optional[str] = ..., config_json: _Optional[str] = ..., fingerprint: _Optional[str] = ..., root_pem: _Optional[bytes] = ...) -> None: ...

class ChallengeRequest(_message.Message):
    __slots__ = ("peer_id", "role", "renewal")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RENEWAL_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    role: str
    renewal: bool
    def __init__(self, peer_id: _Optional[str] = ..., role: _Optional[str] = ..., renewal: _Optional[bool] = ...) -> None: ...

class Challenge(_message.Message):
    __slots__ = ("nonce", "dial_token", "expires_in_s", "latency_probes", "download_bytes", "upload_bytes")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    DIAL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    LATENCY_PROBES_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    dial_token: bytes
    expires_in_s: float
    latency_probes: int
    download_bytes: int
    upload_bytes: int
    def __init__(self, nonce: _Optional[bytes] = ..., dial_token: _Optional[bytes] = ..., expires_in_s: _Optional[float] = ..., latency_probes: _Optional[int] = ..., download_bytes: _Optional[int] = ..., upload_bytes: _Optional[int] = ...) -> None: ...

class LatencyProbe(_message.Message):
    __slots__ = ("nonce", "sequence")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    sequence: int
    def __init__(self, nonce: _Optional[bytes] = ..., sequence: _Optional[int] = ...) -> None: ...

class TransferControl(_message.Message):
    __slots__ = ("nonce", "received_bytes")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    received_bytes: int
    def __init__(self, nonce: _Optional[bytes] = ..., received_bytes: _Optional[int] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("nonce", "data", "last")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    data: bytes
    last: bool
    def __init__(self, nonce: _Optional[bytes] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class UploadReceipt(_message.Message):
    __slots__ = ("received_bytes", "mbit_per_s")
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MBIT_PER_S_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    mbit_per_s: float
    def __init__(self, received_bytes: _Optional[int] = ..., mbit_per_s: _Optional[float] = ...) -> None: ...

class Hardware(_message.Message):
    __slots__ = ("device", "accelerator_memory_bytes", "ram_bytes")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    device: str
    accelerator_memory_bytes: int
    ram_bytes: int
    def __init__(self, device: _Optional[str] = ..., accelerator_memory_bytes: _Optional[int] = ..., ram_bytes: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("nonce", "public_key_pem", "signature", "role", "stage", "fingerprint", "hardware", "announce_host", "announce_port")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_PEM_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCE_HOST_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCE_PORT_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    public_key_pem: bytes
    signature: bytes
    role: str
    stage: int
    fingerprint: str
    hardware: Hardware
    announce_host: str
    announce_port: int
    def __init__(self, nonce: _Optional[bytes] = ..., public_key_pem: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., role: _Optional[str] = ..., stage: _Optional[int] = ..., fingerprint: _Optional[str] = ..., hardware: _Optional[_Union[Hardware, _Mapping]] = ..., announce_host: _Optional[str] = ..., announce_port: _Optional[int] = ...) -> None: ...

class Admitted(_message.Message):
    __slots__ = ("credential_pem", "root_pem", "run_id", "role", "stage", "lifetime_s", "config_json", "initial_peers", "run_signature")
    CREDENTIAL_PEM_FIELD_NUMBER: _ClassVar[int]
    ROOT_PEM_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LIFETIME_S_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    INITIAL_PEERS_FIELD_NUMBER: _ClassVar[int]
    RUN_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    credential_pem: bytes
    root_pem: bytes
    run_id: str
    role: str
    stage: int
    lifetime_s: float
    config_json: str
    initial_peers: _containers.RepeatedScalarFieldContainer[str]
    run_signature: bytes
    def __init__(self, credential_pem: _Optional[bytes] = ..., root_pem: _Optional[bytes] = ..., run_id: _Optional[str] = ..., role: _Optional[str] = ..., stage: _Optional[int] = ..., lifetime_s: _Optional[float] = ..., config_json: _Optional[str] = ..., initial_peers: _Optional[_Iterable[str]] = ..., run_signature: _Optional[bytes] = ...) -> None: ...

class Queued(_message.Message):
    __slots__ = ("position", "retry_after_s")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    position: int
    retry_after_s: float
    def __init__(self, position: _Optional[int] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class Refused(_message.Message):
    __slots__ = ("reason", "field")
    REASON_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    reason: str
    field: str
    def __init__(self, reason: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("admitted", "queued", "refused")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    admitted: Admitted
    queued: Queued
    refused: Refused
    def __init__(self, admitted: _Optional[_Union[Admitted, _Mapping]] = ..., queued: _Optional[_Union[Queued, _Mapping]] = ..., refused: _Optional[_Union[Refused, _Mapping]] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("nonce", "credential_pem", "signature")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_PEM_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    credential_pem: bytes
    signature: bytes
    def __init__(self, nonce: _Optional[bytes] = ..., credential_pem: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class RenewReply(_message.Message):
    __slots__ = ("credential_pem", "lifetime_s")
    CREDENTIAL_PEM_FIELD_NUMBER: _ClassVar[int]
    LIFETIME_S_FIELD_NUMBER: _ClassVar[int]
    credential_pem: bytes
    lifetime_s: float
    def __init__(self, credential_pem: _Optional[bytes] = ..., lifetime_s: _Optional[float] = ...) -> None: ...

class WorkerReport(_message.Message):
    __slots__ = ("nonce", "credential_pem", "signature", "peer_id", "stage", "kind", "feature", "cusum", "replies", "reason")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_PEM_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    CUSUM_FIELD_NUMBER: _ClassVar[int]
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    credential_pem: bytes
    signature: bytes
    peer_id: str
    stage: int
    kind: str
    feature: str
    cusum: float
    replies: int
    reason: str
    def __init__(self, nonce: _Optional[bytes] = ..., credential_pem: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., peer_id: _Optional[str] = ..., stage: _Optional[int] = ..., kind: _Optional[str] = ..., feature: _Optional[str] = ..., cusum: _Optional[float] = ..., replies: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportReceipt(_message.Message):
    __slots__ = ("reporters", "needed", "banned")
    REPORTERS_FIELD_NUMBER: _ClassVar[int]
    NEEDED_FIELD_NUMBER: _ClassVar[int]
    BANNED_FIELD_NUMBER: _ClassVar[int]
    reporters: int
    needed: int
    banned: bool
    def __init__(self, reporters: _Optional[int] = ..., needed: _Optional[int] = ..., banned: _Optional[bool] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("nonce", "credential_pem", "signature", "reason")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_PEM_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    credential_pem: bytes
    signature: bytes
    reason: str
    def __init__(self, nonce: _Optional[bytes] = ..., credential_pem: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveReceipt(_message.Message):
    __slots__ = ("freed",)
    FREED_FIELD_NUMBER: _ClassVar[int]
    freed: bool
    def __init__(self, freed: _Optional[bool] = ...) -> None: ...

class RunFloors(_message.Message):
    __slots__ = ("min_upload_mbit", "min_download_mbit", "max_rtt_ms", "min_accelerator_gb", "min_ram_gb")
    MIN_UPLOAD_MBIT_FIELD_NUMBER: _ClassVar[int]
    MIN_DOWNLOAD_MBIT_FIELD_NUMBER: _ClassVar[int]
    MAX_RTT_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_ACCELERATOR_GB_FIELD_NUMBER: _ClassVar[int]
    MIN_RAM_GB_FIELD_NUMBER: _ClassVar[int]
    min_upload_mbit: float
    min_download_mbit: float
    max_rtt_ms: float
    min_accelerator_gb: float
    min_ram_gb: float
    def __init__(self, min_upload_mbit: _Optional[float] = ..., min_download_mbit: _Optional[float] = ..., max_rtt_ms: _Optional[float] = ..., min_accelerator_gb: _Optional[float] = ..., min_ram_gb: _Optional[float] = ...) -> None: ...

class JoinCheck(_message.Message):
    __slots__ = ("refused", "rtt_ms", "download_mbit", "upload_mbit", "floors", "unreachable", "stage", "server_time", "tolerated_skew_s", "members", "member_samples_per_s", "stage_capacities", "probe_credential_pem", "probe_lifetime_s")
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_MBIT_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_MBIT_FIELD_NUMBER: _ClassVar[int]
    FLOORS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    TOLERATED_SKEW_S_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    STAGE_CAPACITIES_FIELD_NUMBER: _ClassVar[int]
    PROBE_CREDENTIAL_PEM_FIELD_NUMBER: _ClassVar[int]
    PROBE_LIFETIME_S_FIELD_NUMBER: _ClassVar[int]
    refused: Refused
    rtt_ms: float
    download_mbit: float
    upload_mbit: float
    floors: RunFloors
    unreachable: str
    stage: int
    server_time: float
    tolerated_skew_s: float
    members: _containers.RepeatedCompositeFieldContainer[StageMember]
    member_samples_per_s: _containers.RepeatedScalarFieldContainer[float]
    stage_capacities: _containers.RepeatedCompositeFieldContainer[StageCapacity]
    probe_credential_pem: bytes
    probe_lifetime_s: float
    def __init__(self, refused: _Optional[_Union[Refused, _Mapping]] = ..., rtt_ms: _Optional[float] = ..., download_mbit: _Optional[float] = ..., upload_mbit: _Optional[float] = ..., floors: _Optional[_Union[RunFloors, _Mapping]] = ..., unreachable: _Optional[str] = ..., stage: _Optional[int] = ..., server_time: _Optional[float] = ..., tolerated_skew_s: _Optional[float] = ..., members: _Optional[_Iterable[_Union[StageMember, _Mapping]]] = ..., member_samples_per_s: _Optional[_Iterable[float]] = ..., stage_capacities: _Optional[_Iterable[_Union[StageCapacity, _Mapping]]] = ..., probe_credential_pem: _Optional[bytes] = ..., probe_lifetime_s: _Optional[float] = ...) -> None: ...

class StageCapacity(_message.Message):
    __slots__ = ("stage", "members", "unknown_members", "samples_per_s")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    stage: int
    members: int
    unknown_members: int
    samples_per_s: float
    def __init__(self, stage: _Optional[int] = ..., members: _Optional[int] = ..., unknown_members: _Optional[int] = ..., samples_per_s: _Optional[float] = ...) -> None: ...

class StageMember(_message.Message):
    __slots__ = ("address", "samples_per_s", "peer_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    samples_per_s: float
    peer_id: str
    def __init__(self, address: _Optional[str] = ..., samples_per_s: _Optional[float] = ..., peer_id: _Optional[str] = ...) -> None: ...
