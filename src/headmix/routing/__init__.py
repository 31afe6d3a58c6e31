"""Routers (MoA eq. 2-3, 7-9) and their auxiliary losses (eq. 13-17)."""

from .losses import load_balancing_loss, router_z_loss, routing_losses
from .router import RENORMALIZE, ROUTERS, Routing, TopKRouter
from .stats import load_summary

__all__ = ["Routing", "TopKRouter", "RENORMALIZE", "ROUTERS", "load_balancing_loss", "router_z_loss", "routing_losses", "load_summary"]
