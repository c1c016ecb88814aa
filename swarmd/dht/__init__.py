"""swarmd's Kademlia DHT: signed, expiring, many-writer records over the project's RPC.

See docs/dht.md for the record schema, the settings and how the daemon uses it.
"""

from .config import DHTConfig
from .errors import (CallFailed, DHTError, DHTProtocolError, DHTUsageError, PeerTimeout, PeerUnreachable,
                     RecordRejected, RemoteFailure, WrongPeer)
from .network import Caller, InMemoryFabric, InMemoryNetwork, Network, Reply
from .node import Announcement, DHTNode
from .records import Record, dht_key, key_id
from .routing import Contact

__all__ = [
    "Announcement", "CallFailed", "Caller", "Contact", "DHTConfig", "DHTError", "DHTNode", "DHTProtocolError",
    "DHTUsageError", "InMemoryFabric", "InMemoryNetwork", "Network", "PeerTimeout", "PeerUnreachable",
    "Record", "RecordRejected", "RemoteFailure", "Reply", "WrongPeer", "dht_key", "key_id",
]
