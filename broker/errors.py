"""The broker's error tree: everything raised by broker I/O derives from BrokerError."""


class BrokerError(Exception):
    """Base class of every error raised by the broker package."""


class BrokerConnectionError(BrokerError):
    """Redis or ZeroMQ could not be reached (after the configured retries)."""


class DecodeError(BrokerError):
    """Bytes from the wire (a stream entry, a ZeroMQ message, a snapshot) are malformed."""


class ConfigMismatch(BrokerError):
    """A process's run configuration hash differs from the one stored for the run."""


class Superseded(BrokerError):
    """Another process joined the run as this learner (a newer epoch of its id): this one must
    stop, and leave the learner's records to the newer process."""
