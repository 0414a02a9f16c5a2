package io.github.idempotency.servlet;

import com.standardwebhooks.Webhook;
import java.nio.charset.StandardCharsets;
import java.util.Collections;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import tools.jackson.databind.JsonNode;
import tools.jackson.databind.json.JsonMapper;

/**
 * Webhook receivers: filter options that take the key from where senders put it. Standard Webhooks
 * (https://www.standardwebhooks.com): each delivery is verified with the {@code standardwebhooks}
 * library (signature, and a timestamp within its tolerance) before anything is claimed, the key is the
 * {@code webhook-id} header and the scope {@code webhook:} and the sender. Senders that keep their event id in the body
 * (Stripe's {@code id}): {@link #bodyKey}.
 */
public final class Webhooks {
	private static final JsonMapper JSON = JsonMapper.builder().build();

	private Webhooks() {
	}

	/**
	 * Makes {@code options} those of a Standard Webhooks receiver: POST only, verified by webhook, keyed
	 * by {@code webhook-id}, scoped by {@code "webhook:" + sender}.
	 *
	 * @param options the options to change
	 * @param webhook the verifier, {@code new Webhook("whsec_...")} of com.standardwebhooks:standardwebhooks
	 * @param sender who sends the events: their scope is {@code "webhook:" + sender}
	 * @return options
	 */
	public static IdempotencyOptions standard(IdempotencyOptions options, Webhook webhook, String sender) {
		return options.methods(List.of("POST"))
				.verify((request, body) -> webhook.verify(new String(body, StandardCharsets.UTF_8), headers(request)))
				.key((request, body) -> request.getHeader("webhook-id"))
				.scope(request -> "webhook:" + sender);
	}

	/**
	 * A key source reading a string field of the JSON body (Stripe keeps the event id in {@code id}).
	 *
	 * @param field the field's name
	 * @return the source: null when the body has no such field; a field that is not a string is a
	 *     malformed key (400)
	 */
	public static IdempotencyOptions.KeySource bodyKey(String field) {
		return (request, body) -> {
			JsonNode node;
			try {
				node = JSON.readTree(body);
			} catch (RuntimeException e) {
				return null;
			}
			JsonNode value = node == null ? null : node.get(field);
			if (value == null || value.isNull() || value.isMissingNode()) {
				return null;
			}
			if (!value.isString()) {
				throw new IllegalArgumentException("the body's " + field + " is not a string");
			}
			return value.asString();
		};
	}

	/** The request's headers, names in any case. */
	private static Map<String, List<String>> headers(jakarta.servlet.http.HttpServletRequest request) {
		Map<String, List<String>> headers = new TreeMap<>(String.CASE_INSENSITIVE_ORDER);
		for (String name : Collections.list(request.getHeaderNames())) {
			headers.put(name, Collections.list(request.getHeaders(name)));
		}
		return headers;
	}
}
