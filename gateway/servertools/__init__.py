"""Server tools the gateway runs itself: `web_search` (a SearXNG backend) and `web_fetch` (an
allow-list of hosts, public addresses only), for agents that declare Anthropic's or OpenAI's hosted
tools. Off unless routes.yaml has a `server_tools` block (routing/table.py).

guard.py   what a URL may reach (allow-list, resolved addresses), pure but for the resolver
http.py    one bounded GET to a checked address (h11), no redirects of its own
text.py    a page as text for the model
execute.py web_search and web_fetch as values: results, or an error code
wires.py   the tools, calls and result blocks of Messages and Responses, and their replay
loop.py    the rounds: the model calls, the gateway runs the tool and sends the conversation on
sse.py     the final answer as a streaming client's events
"""
