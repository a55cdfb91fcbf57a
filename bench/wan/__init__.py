"""The WAN emulation harness: a swarm's processes in network namespaces behind emulated links.

profiles.py (link settings, the 10% rule), topology.py (namespaces, veths, tc), relay.py (the
userspace delay relay), probe.py and links.py (measuring what was made), swarm.py (the demo on it).
"""
