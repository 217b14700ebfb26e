"""Membership as numbered views, agreed on by a majority of the previous view (no split brain).

A sans-IO state machine per member (:class:`Membership`): the runtime passes in what
happens (messages, join requests, a SIGTERM, a suspected death, the time) and sends what
comes back. No socket, no clock, no import of the runtime, transports or protocols.
See docs/design/membership.md.
"""

from __future__ import annotations

from hopnet.membership.machine import Membership, MembershipConfig
from hopnet.membership.messages import (
    Accept, Accepted, Beat, ChangeRequest, Commit, JoinRequest, Message, Nack, Prepare,
    Promise, Requests, Send,
)
from hopnet.membership.view import NO_VIEW, Ballot, Change, View, accepts, view_relation

__all__ = [
    "NO_VIEW", "Accept", "Accepted", "Ballot", "Beat", "Change", "ChangeRequest", "Commit",
    "JoinRequest", "Membership", "MembershipConfig", "Message", "Nack", "Prepare", "Promise",
    "Requests", "Send", "View", "accepts", "view_relation",
]
