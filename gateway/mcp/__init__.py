"""Delegation over MCP: the gateway as the tool a frontier agent hands bounded work to."""
