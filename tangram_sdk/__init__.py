"""Tangram's SDK: an RL framework's side of the HTTP API of `tangram serve`.

* :mod:`tangram_sdk.client`: ``TangramClient`` (asyncio) and ``TangramSyncClient``;
* :mod:`tangram_sdk.integrations`: the adapters in the shapes RL frameworks expect (a verl
  tool and reward, a gymnasium env, a SkyRL-gym env, a teacher client);
* :mod:`tangram_sdk.units`: the parser of unit sets (``"1-8"``), part of the wire format,
  which the server reads too.

It imports nothing of the core (tangram/, tests/test_layering.py) and, besides the standard
library, needs only ``httpx``; each adapter also imports its own framework, which the user
has. So a training job that only talks to a server needs neither the core nor its
dependencies (numpy, simpy, pandas, docker...): it installs the distribution ``tangram-sdk``
(this directory's pyproject.toml; from a checkout, ``pip install ./tangram_sdk``), which
needs only httpx. The main distribution, tangram-rl, ships this package too. The old names
``tangram.client`` and ``tangram.integrations.*`` stay, as the same modules
(tangram/client.py).
"""
