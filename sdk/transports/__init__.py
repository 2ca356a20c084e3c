"""The SDK's data paths to one server: the contract (base.py), tcp, the one-sided
protocol (onesided.py) and its movers (shm.py, nixl.py), and the factory.

Import the modules themselves (``gcache.sdk.transports.tcp`` ...): this package
imports nothing, so loading it never loads NIXL.
"""
