"""Starting MPS control daemons: the launch seam (:mod:`.launch`), the agent's own launcher
(:mod:`.direct`), and the MPS host's wire protocol (:mod:`.protocol`) with the agent's client
of it (:mod:`.host_client`). Both the agent and ``gpu-agent mps-host`` import it; it imports
neither."""
